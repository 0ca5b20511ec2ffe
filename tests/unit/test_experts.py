"""MoE grouped GEMMs in the L3 kernel comparison: per routed token where the tokens are known, on EP-group
means where not (argus.detectors.experts, argus.detectors.kernel_excess)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.experts import (
    ep_group_ids,
    group_means,
    hot_experts,
    is_grouped_gemm,
    per_token_scale,
    repeated_expert,
)
from argus.detectors.kernel_excess import detect_kernel_excess
from argus.detectors.l3_ranks import KernelTotals, detect_rank_excess
from argus.producers.topology import build_topology
from argus.streams.diagnosis import DiagnosisParams

GROUPED = ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape"
           "<cute::tuple<int, int, int> > > >(...)")
CALLS = 48


def _job(load: np.ndarray, slow: dict[int, float] | None = None, seed: int = 0, noise: float = 0.02,
         speed: dict[int, float] | None = None) -> tuple[list[KernelTotals], dict[int, int]]:
    """Eight dense kernels and one grouped GEMM on ``load.size`` ranks; the grouped GEMM's time per call is
    its rank's routed tokens (``load`` x 4096) times its slowness (``slow``: rank -> factor); ``speed``: rank ->
    factor on everything it runs. Returns the totals and each rank's tokens."""
    rng = np.random.default_rng(seed)
    n = load.size
    tokens = {r: round(4096 * float(load[r])) * CALLS for r in range(n)}
    out = []
    for k in range(8):
        base = float(rng.lognormal(np.log(1e5), 0.5))
        t = KernelTotals(f"sm90_xmma_gemm_{k}", 7)
        for r in range(n):
            d = base * (speed or {}).get(r, 1.0) * np.exp(noise * rng.standard_normal(CALLS))
            t.total_ns[r], t.calls[r], t.median_ns[r] = float(d.sum()), float(CALLS), float(np.median(d) * CALLS)
        out.append(t)
    g = KernelTotals(GROUPED, 7)
    for r in range(n):
        d = 50.0 * tokens[r] / CALLS * (slow or {}).get(r, 1.0) * (speed or {}).get(r, 1.0) * np.exp(
            noise * rng.standard_normal(CALLS))
        g.total_ns[r], g.calls[r], g.median_ns[r] = float(d.sum()), float(CALLS), float(np.median(d) * CALLS)
    out.append(g)
    return out, tokens


def _conserved(ep: int, groups: int, hot: float, pos: int = 1) -> np.ndarray:
    """Per rank (``groups`` EP groups of ``ep`` in Megatron order): its share of its group's tokens, the
    position ``pos`` of every group ``hot`` times an even share, the others the rest."""
    cold = (ep - hot) / (ep - 1)
    shares = np.array([hot if i == pos else cold for i in range(ep)])
    return np.tile(shares, groups)


def test_grouped_gemm_names() -> None:
    assert is_grouped_gemm(GROUPED)
    assert is_grouped_gemm("void cutlass::Kernel<cutlass::gemm::kernel::GemmGrouped<...> >(...)")
    assert not is_grouped_gemm("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")
    assert not is_grouped_gemm("ncclDevKernel_AllReduce_Sum_bf16_RING_LL")


def test_group_means_and_per_token_scale() -> None:
    v = np.array([[1.0], [3.0], [5.0], [7.0], [9.0]])
    means, enough = group_means(v, np.array([0, 0, 1, 1, -1]))
    assert means[:, 0].tolist() == [2.0, 2.0, 6.0, 6.0, 9.0] and bool(enough)
    assert not bool(group_means(v, np.array([0, 0, 0, 0, 0]))[1])
    scale = per_token_scale([0, 1, 2], {0: 100, 1: 200, 2: 400})
    assert scale is not None and scale.tolist() == [2.0, 1.0, 0.5]
    assert per_token_scale([0, 1, 2], {0: 100, 1: 200}) is None and per_token_scale([0, 1], None) is None
    assert per_token_scale([0, 1], {0: 0, 1: 5}) is None
    topo = build_topology("j", 8, ep=4)
    assert ep_group_ids(topo, [0, 3, 4, 7]).tolist() == [0, 0, 1, 1]
    assert ep_group_ids(build_topology("j", 8), [0, 1]) is None and ep_group_ids(None, [0]) is None


@settings(max_examples=25, deadline=None)
@given(hot=st.floats(1.3, 2.6), ep=st.sampled_from([4, 8]), known=st.booleans(), seed=st.integers(0, 10_000))
def test_a_hot_expert_is_never_named(hot: float, ep: int, known: bool, seed: int) -> None:
    # 16 ranks, EP groups of `ep`: every group's position 1 gets `hot` times an even share of the tokens.
    topo = build_topology("j", 16, ep=ep)
    totals, tokens = _job(_conserved(ep, 16 // ep, hot), seed=seed)
    assert detect_kernel_excess(totals, topo, expert_tokens=tokens if known else None) == []


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_a_slow_expert_rank_is_named_with_its_grouped_gemm(known: bool, seed: int) -> None:
    topo = build_topology("j", 16, ep=4)
    totals, tokens = _job(_conserved(4, 4, 1.8), slow={6: 1.6}, seed=seed)
    res = detect_kernel_excess(totals, topo, expert_tokens=tokens if known else None)
    assert [(r.kind, r.ranks, r.kernel) for r in res] == [(FindingKind.KERNEL_DEGRADED, (6,), GROUPED)]
    # Per token (known) its grouped GEMM runs 1.6x; on group means (unknown) the excess it carries reads the same.
    assert 1.45 < res[0].evidence["top_kernels_ratio"][f"{GROUPED}@7"] < 1.75


@pytest.mark.parametrize("seed", range(4))
def test_a_group_mean_is_judged_by_the_noise_of_a_mean(seed: int) -> None:
    # 64 ranks, eight EP groups of eight, tokens unknown: rank 63's grouped GEMM x1.15 raises its group's mean
    # by 2 %. That mean carries 1/sqrt(8) of one member's noise; judged by one member's, it went unnamed.
    topo = build_topology("j", 64, ep=8)
    load = _conserved(8, 8, 1.6)
    assert detect_kernel_excess(_job(load, seed=seed, noise=0.05)[0], topo) == []
    res = detect_kernel_excess(_job(load, slow={63: 1.15}, seed=seed, noise=0.05)[0], topo)
    assert [(r.ranks, r.kernel) for r in res] == [((63,), GROUPED)]


def test_a_slow_hot_expert_is_named_per_token() -> None:
    # The hot expert itself is also slow: per token it runs 1.6x its peers.
    topo = build_topology("j", 8, ep=8)
    totals, tokens = _job(_conserved(8, 1, 2.5, pos=3), slow={3: 1.6})
    res = detect_kernel_excess(totals, topo, expert_tokens=tokens)
    assert [r.ranks for r in res] == [(3,)]


def test_one_expert_group_without_tokens_is_not_judged() -> None:
    # One EP group and no token counts: a hot expert and a slow one look the same; neither is named.
    topo = build_topology("j", 8, ep=8)
    hot, _ = _job(_conserved(8, 1, 2.0))
    slow, _ = _job(np.ones(8), slow={3: 2.0})
    assert detect_kernel_excess(hot, topo) == [] and detect_kernel_excess(slow, topo) == []
    # Without a topology (no EP known), grouped GEMMs compare as any kernel: the slow one is named.
    assert [r.ranks for r in detect_kernel_excess(slow)] == [(3,)]


@pytest.mark.parametrize("seed", range(4))
def test_a_stage_of_one_expert_group_compares_its_group_with_the_other_stages(seed: int) -> None:
    # DP 8 x PP 2 x EP 8: one EP group per stage, tokens unknown. The router conserves each group's tokens,
    # so the groups' means compare across the stages: rank 10's grouped GEMM x1.5 puts its group in excess,
    # and it alone can carry that excess (its stage's hot expert runs 1.2x an even share); its dense kernels
    # are judged in its stage. Each stage's layers have their own hot expert (another position in each).
    topo = build_topology("j", 8, pp=2, ep=8)
    load = np.concatenate([_conserved(8, 1, 2.0, pos=1), _conserved(8, 1, 1.2, pos=5)])
    healthy, _ = _job(load, seed=seed)
    assert detect_kernel_excess(healthy, topo) == []
    slow, _ = _job(load, slow={10: 1.5}, seed=seed)
    assert [(r.ranks, r.kernel) for r in detect_kernel_excess(slow, topo)] == [((10,), GROUPED)]
    # A hot expert of 1.7x in its group could carry the excess as well: which member is slow is not told.
    load[13] = 1.7
    load[8:16] *= 8 / load[8:16].sum()
    assert detect_kernel_excess(_job(load, slow={10: 1.5}, seed=seed)[0], topo) == []
    # A dense kernel slower on a whole stage is that stage's work (or a stage fault), not a rank's.
    for r in range(8, 16):
        healthy[3].total_ns[r] *= 1.3
        healthy[3].median_ns[r] *= 1.3
    assert detect_kernel_excess(healthy, topo) == []


@pytest.mark.parametrize("seed", range(4))
def test_stages_of_one_expert_pair_name_the_slow_member(seed: int) -> None:
    # DP 2 x PP 2 x EP 2: one EP group of two per stage. A routing skew in a pair conserves the pair's mean;
    # rank 3's grouped GEMM x1.4 puts its pair in excess, all of it over its partner's time.
    topo = build_topology("j", 2, pp=2, ep=2)
    assert detect_kernel_excess(_job(np.array([1.0, 1.0, 1.3, 0.7]), seed=seed)[0], topo) == []
    res = detect_kernel_excess(_job(np.ones(4), slow={3: 1.4}, seed=seed)[0], topo)
    assert [(r.ranks, r.kernel) for r in res] == [((3,), GROUPED)]
    # Routed 0.9 of an even share against its partner's 1.1, its lead (0.16) is under 3/4 of the pair's
    # excess (0.36): a partner hot and slow reads the same. Neither is named.
    assert detect_kernel_excess(_job(np.array([1.0, 1.0, 1.1, 0.9]), slow={3: 1.4}, seed=seed)[0], topo) == []


@pytest.mark.parametrize("seed", range(4))
def test_a_hot_expert_does_not_carry_a_few_percent_of_its_pairs_excess(seed: int) -> None:
    # DP 2 x PP 4 x EP 2: one pair per stage, its first member routed 1.5x an even share in every stage. Stage
    # 2's pair runs 3 % over the others (its layers, or noise): significant on a pair's mean, but the hot
    # member's lead covers it many times over, and what it carries is 3 % of its own time, under
    # kernel_min_ratio (sized by its time over its peers', a hot expert read 3x; the evaluation's 931642997).
    topo = build_topology("j", 2, pp=4, ep=2)
    load = np.tile([1.5, 0.5], 4)
    totals, _ = _job(load, seed=seed, noise=0.005, slow={4: 1.03, 5: 1.03})
    assert detect_kernel_excess(totals, topo) == []
    # The hot member x1.4 is named, sized as its own factor. (Its cold partner x1.4 would put the pair in
    # excess as a hot member x1.13 does: then the hot one is named, x1.13.)
    [res] = detect_kernel_excess(_job(load, seed=seed, noise=0.005, slow={4: 1.4})[0], topo)
    assert res.ranks == (4,) and 1.3 < res.evidence["top_kernels_ratio"][f"{GROUPED}@7"] < 1.5


@pytest.mark.parametrize("seed", range(4))
def test_a_hot_experts_rank_is_no_slow_rank_but_a_slow_gpu_is(seed: int) -> None:
    # One EP group of eight (tokens unknown): the hot expert's grouped GEMM runs 2.3x, which says nothing of
    # its GPU; the rank comparison across kernels reads the dense ones. A GPU slow in everything is named.
    topo = build_topology("j", 8, ep=8)
    hot, _ = _job(_conserved(8, 1, 2.3), seed=seed)
    assert detect_rank_excess(hot, topo) == []
    slow, _ = _job(_conserved(8, 1, 2.3), seed=seed, speed={5: 1.4})
    assert [r.ranks for r in detect_rank_excess(slow, topo)] == [(5,)]


@pytest.mark.parametrize("seed", range(4))
def test_ranks_own_speeds_do_not_make_a_group_mean_slow(seed: int) -> None:
    # Two EP groups of two (a DP2 x TP2 stage): the hot member of the first group is also a 3 % faster GPU
    # and its cold peer 3 % slower. A group mean that mixed their speeds read as the cold member's excess.
    topo = build_topology("j", 4, ep=2)
    totals, _ = _job(_conserved(2, 2, 1.5), seed=seed, noise=0.005, speed={0: 1.03, 1: 0.97})
    assert detect_kernel_excess(totals, topo) == []


@pytest.mark.parametrize("seed", range(4))
def test_hot_experts_on_slower_gpus_make_no_group_mean_slow(seed: int) -> None:
    # Two EP groups of two (a DP2 x TP2 stage, the evaluation's 145223679): both hot members (1.3x an even
    # share) run on GPUs 5 % slower than their cold partners. Speeds read against each rank's peers put a slow
    # GPU 5 % over a fast one's reference and back, so each hot member read 6 % over its group's mean.
    topo = build_topology("j", 4, ep=2)
    totals, _ = _job(_conserved(2, 2, 1.3, pos=0), seed=seed, noise=0.005, speed={0: 1.05, 2: 1.05})
    assert detect_kernel_excess(totals, topo) == []


def test_ranks_at_one_expert_in_every_group_are_routing_not_faults() -> None:
    topo = build_topology("j", 16, ep=8)  # groups 0-7 and 8-15
    assert repeated_expert({6, 14}, topo) == {6, 14}  # position 6 of both groups
    assert repeated_expert({6}, topo) == set()  # one group only: a rank of its own
    assert repeated_expert({6, 13}, topo) == set()  # different positions
    assert repeated_expert({6, 14, 3}, topo) == {6, 14}  # in every group, whatever else is named
    assert repeated_expert({1, 2}, build_topology("j", 8, ep=8)) == set()  # one group: nothing to say
    assert repeated_expert({6, 14}, build_topology("j", 16)) == set() and repeated_expert({1}, None) == set()


def test_ranks_at_one_expert_in_some_groups_are_routing_but_a_slow_host_is_not() -> None:
    # DP 8 x PP 4 x EP 8: one EP group per stage. Position 5 named in two of the four groups, alone in each:
    # the groups routing to a popular expert (a fault does not pick the same expert twice).
    topo = build_topology("j", 8, pp=4, ep=8)
    assert repeated_expert({21, 29}, topo) == {21, 29}
    assert repeated_expert({21, 29, 3}, topo) == {21, 29}  # rank 3 is the only one at its position: its own
    # A slow host holds whole groups (here DP 16 x TP 2 x EP 4: host 0 holds groups {0,2,4,6} and {1,3,5,7}):
    # every position of them is named, more than one member of each, so no position is routing.
    host = build_topology("j", 16, tp=2, ep=4)
    assert repeated_expert(set(range(8)), host) == set()
    assert repeated_expert({21, 29, 22}, topo) == set()  # a group naming two members: not one expert


def test_a_rank_routed_more_than_its_group_is_a_hot_expert() -> None:
    topo = build_topology("j", 16, ep=4)  # groups 0-3, 4-7, ...
    tokens = {r: 1000 for r in range(16)}
    tokens[5], tokens[6] = 2100, 1050  # a hot expert; routing noise
    assert hot_experts({5, 6, 9}, topo, tokens, 1.1) == {5}
    # Without counts, or without expert parallelism, nothing is hot.
    for counts in (None, {}, {5: 2000}):
        assert hot_experts({5}, topo, counts, 1.1) == set()
    assert hot_experts({5}, build_topology("j", 16), tokens, 1.1) == set()


@pytest.mark.parametrize("ratio", [1.0, 0.5, float("nan")])
def test_the_hot_expert_ratio_is_validated(ratio: float) -> None:
    with pytest.raises(DetectorError):
        DiagnosisParams(hot_expert_tokens_ratio=ratio)
