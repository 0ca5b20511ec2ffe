"""Hosts whose GPUs run slow together, each under the per-rank gates (argus.detectors.hosts)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.hosts import HostParams, detect_host_excess
from argus.detectors.l3_ranks import KernelTotals, detect_rank_excess
from argus.producers.topology import build_topology

CALLS = 40


def _totals(world: int, slow: dict[int, float], seed: int, noise: float = 0.05,
            rank_sigma: float = 0.015) -> list[KernelTotals]:
    """Twelve compute kernels and one collective on ``world`` ranks: per rank a persistent speed
    (lognormal, ``rank_sigma``) times ``slow`` (rank -> factor), per call lognormal ``noise``."""
    rng = np.random.default_rng(seed)
    speed = rng.lognormal(0.0, rank_sigma, world)
    out = []
    for k in range(12):
        base = float(rng.lognormal(np.log(2e5), 0.7))
        t = KernelTotals(f"sm90_xmma_gemm_{k}", 7)
        for r in range(world):
            d = base * speed[r] * slow.get(r, 1.0) * rng.lognormal(0.0, noise, CALLS)
            t.total_ns[r], t.calls[r], t.median_ns[r] = float(d.sum()), float(CALLS), float(np.median(d) * CALLS)
        out.append(t)
    nccl = KernelTotals("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 20)
    for r in range(world):
        nccl.total_ns[r], nccl.calls[r], nccl.median_ns[r] = 5e6 * slow.get(r, 1.0), 10.0, 5e6
    return [*out, nccl]


@pytest.mark.parametrize("seed", range(6))
def test_a_host_eight_percent_slower_is_found_where_its_ranks_alone_are_not(seed: int) -> None:
    topo = build_topology("j", 32)  # four hosts of eight
    totals = _totals(32, {r: 1.08 for r in range(8, 16)}, seed)
    assert detect_rank_excess(totals, topo) == []  # each rank alone is under the per-rank gates
    found = detect_host_excess(totals, topo)
    assert {r.ranks[0] for r in found} <= set(range(8, 16))
    assert len(found) >= 6 and all(r.kind is FindingKind.RANK_DEGRADED for r in found)
    ev = found[0].evidence
    assert ev["host"] == "node0001" and 1.05 < ev["host_speed_ratio"] < 1.11
    assert all(r.excess_ns > 0 and not r.kernel.startswith("nccl") for r in found)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), world=st.sampled_from([16, 32, 64]))
def test_healthy_hosts_are_never_slow(seed: int, world: int) -> None:
    assert detect_host_excess(_totals(world, {}, seed), build_topology("j", world)) == []


@pytest.mark.parametrize("seed", range(6))
def test_one_straggler_named_alone_makes_no_slow_host(seed: int) -> None:
    topo = build_topology("j", 32)
    totals = _totals(32, {11: 1.6}, seed)
    assert [r.ranks for r in detect_rank_excess(totals, topo)] == [(11,)]
    assert detect_host_excess(totals, topo, exclude={11}) == []


def test_a_host_that_is_the_whole_set_or_unknown_hosts_are_not_tested() -> None:
    slow = {r: 1.3 for r in range(8)}
    assert detect_host_excess(_totals(8, slow, 1), build_topology("j", 8)) == []  # one host: the stage's matter
    assert detect_host_excess(_totals(16, slow, 1), None) == []
    # Every rank of a set already named, or too few left: nothing to compare.
    topo = build_topology("j", 16)
    assert detect_host_excess(_totals(16, slow, 1), topo, exclude=range(16)) == []
    assert detect_host_excess(_totals(16, slow, 1), topo, exclude=range(11)) == []


@pytest.mark.parametrize("bad", [{"min_ratio": 1.0}, {"alpha": 0.0}, {"min_share": 0.0}, {"min_host_ranks": 1},
                                 {"spread_floor": 0.0}])
def test_bad_params_raise(bad: dict[str, float]) -> None:
    with pytest.raises(DetectorError):
        HostParams(**bad)  # type: ignore[arg-type]
