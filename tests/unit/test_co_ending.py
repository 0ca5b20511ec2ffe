"""Which ranks' collective calls end together (argus.detectors.co_ending): the group kind of a collective
stream from times alone, whatever the clocks' offsets and drift."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.detectors.co_ending import (
    KINDS,
    CoEndParams,
    StreamCalls,
    co_ending_kinds,
    kind_pairs,
    pair_ratio,
    sampled_ranks,
    stream_kind,
)
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology, ParallelGroup

P = CoEndParams()
I64 = npt.NDArray[np.int64]


def _calls(group: I64, rng: np.random.Generator, n: int = 60, jitter_ns: float = 2_000.0,
           together: bool = True, arrive_with: I64 | None = None) -> dict[int, StreamCalls]:
    """A stream of ``n`` collectives: rank ``r`` is in group ``group[r]``; every rank arrives with its own
    noise (50 µs) on a common schedule, each group ends at its last arrival plus the transfer (100 µs) and each
    member within ``jitter_ns`` of that (``together=False``: each rank at its own arrival, no group at all).
    Each rank's clock is off by up to 50 ms and drifts by up to 10 ppm. ``arrive_with``: ranks of one label
    arrive at once (to within 1 µs)."""
    world = group.size
    base = np.cumsum(rng.uniform(0.5e6, 3e6, n))  # calls 0.5-3 ms apart
    arrive = base[None, :] + rng.normal(0.0, 50e3, (world, n)) + rng.normal(0.0, 20e3, (world, 1))
    if arrive_with is not None:
        arrive = arrive[arrive_with] + rng.normal(0.0, 1e3, (world, n))
    if together:
        last = np.zeros((world, n))
        for g in np.unique(group):
            members = group == g
            last[members] = arrive[members].max(axis=0)
    else:
        last = arrive
    end = last + 100e3 * rng.lognormal(0.0, 0.05, n)[None, :] + rng.uniform(0.0, jitter_ns, (world, n))
    offset = rng.uniform(-50e6, 50e6, (world, 1))
    drift = 1.0 + rng.uniform(-1e-5, 1e-5, (world, 1))
    start, end = (arrive * drift + offset).astype(np.int64), (end * drift + offset).astype(np.int64)
    steps = np.arange(n, dtype=np.int64) // 6
    return {r: StreamCalls(start[r], end[r], steps, np.zeros(n, dtype=np.int64)) for r in range(world)}


def _expected(topo: JobTopology, kind: ParallelGroup) -> ParallelGroup:
    """``kind``, or the first kind of :data:`KINDS` with the very same groups (they cannot be told apart)."""
    def partition(k: ParallelGroup) -> set[frozenset[int]]:
        col = topo.array(k.column)
        return {frozenset(np.flatnonzero(col == g).tolist()) for g in np.unique(col)}

    return next(k for k in KINDS if partition(k) == partition(kind))


@settings(max_examples=30, deadline=None)
@given(dp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]),
       ep=st.sampled_from([1, 2, 4]), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
def test_the_kind_whose_members_end_together_is_recovered(dp: int, tp: int, pp: int, ep: int, kind: ParallelGroup,
                                                          seed: int) -> None:
    ep = ep if dp % ep == 0 else 1
    topo = build_topology("j", dp, tp, pp, ep)
    col = topo.array(kind.column)
    if np.unique(col, return_counts=True)[1].max() < 2:
        return  # the kind has no group of two ranks: nothing runs in it
    calls = _calls(col, np.random.default_rng(seed))
    assert stream_kind(calls, kind_pairs(topo, P), P) is _expected(topo, kind)


@pytest.mark.parametrize("seed", range(5))
def test_pairs_that_arrive_together_tell_nothing_and_are_left_out(seed: int) -> None:
    # DP2 x TP4: the data-parallel pairs {0, 4} and {1, 5} arrive within 1 µs (the same layers before the
    # collective), so no timestamp shows their ends spreading less than their starts; {2, 6} and {3, 7} do.
    topo = build_topology("j", 2, 4)
    calls = _calls(topo.array("dp_group"), np.random.default_rng(seed), arrive_with=np.array([0, 1, 2, 3, 0, 1, 6, 7]))
    assert stream_kind(calls, kind_pairs(topo, P), P) is ParallelGroup.DP


@pytest.mark.parametrize("dims", [(2, 2, 2), (4, 2, 2), (2, 4, 2), (2, 1, 4)])
def test_a_group_larger_than_every_kind_is_named_none(dims: tuple[int, int, int]) -> None:
    dp, tp, pp = dims
    topo = build_topology("j", dp, tp, pp)
    rng = np.random.default_rng(sum(dims))
    pairs = kind_pairs(topo, P)
    # The model-parallel group (TP x PP: every rank of one data-parallel index) holds the TP groups, and the
    # PP groups (with one TP rank it is the PP group, which no stream is named from times): its members
    # co-end beyond each kind's groups.
    mp = (topo.array("rank") // tp) % dp
    assert stream_kind(_calls(mp, rng), pairs, P) is ParallelGroup.NONE
    # The whole job (the default process group) co-ends beyond every kind's groups.
    assert stream_kind(_calls(np.zeros(topo.world_size, dtype=np.int64), rng), pairs, P) is ParallelGroup.NONE


def test_ranks_that_end_on_their_own_are_no_group() -> None:
    topo = build_topology("j", 4, 2, 2)
    calls = _calls(topo.array("tp_group"), np.random.default_rng(1), together=False)
    assert stream_kind(calls, kind_pairs(topo, P), P) is ParallelGroup.NONE
    assert co_ending_kinds({20: calls}, topo) == {}


def test_streams_are_named_one_by_one() -> None:
    topo = build_topology("j", 2, 4, 1)
    rng = np.random.default_rng(2)
    calls = {20: _calls(topo.array("tp_group"), rng), 24: _calls(topo.array("dp_group"), rng)}
    assert co_ending_kinds(calls, topo) == {20: ParallelGroup.TP, 24: ParallelGroup.DP}
    # A rank the test never reads can be missing; one it reads missing leaves its pairs uncompared.
    assert sampled_ranks(kind_pairs(topo, P)) <= set(range(8))


def test_a_pair_ratio_ignores_clock_offset_and_drift_and_a_cut_call() -> None:
    topo = build_topology("j", 2, 2, 1)
    calls = _calls(topo.array("tp_group"), np.random.default_rng(3))
    a, b, other = calls[0], calls[1], calls[2]
    together = pair_ratio(a, b, P)
    assert together is not None and together <= P.ratio
    apart = pair_ratio(a, other, P)
    assert apart is not None and apart > 0.5
    cut = StreamCalls(b.start_ns[1:], b.end_ns[1:], b.step[1:], b.name[1:])  # the trace began a call later
    shifted = pair_ratio(a, cut, P)
    assert shifted is not None and shifted <= P.ratio
    renamed = StreamCalls(b.start_ns, b.end_ns, b.step, b.name + 1)  # other kernels: not the same collectives
    assert pair_ratio(a, renamed, P) is None
    few = StreamCalls(b.start_ns[:5], b.end_ns[:5], b.step[:5], b.name[:5])
    assert pair_ratio(a, few, P) is None


def test_calls_outside_common_steps_are_left_out() -> None:
    topo = build_topology("j", 2, 2, 1)
    calls = _calls(topo.array("tp_group"), np.random.default_rng(4))
    a, b = calls[0], calls[1]
    # Rank b's trace holds two more steps at its start (12 calls, 6 per step): matched by step, not by index.
    extra = StreamCalls(np.concatenate([b.start_ns[:12] - 10**9, b.start_ns]),
                        np.concatenate([b.end_ns[:12] - 10**9, b.end_ns]),
                        np.concatenate([b.step[:12] + 1000, b.step]), np.concatenate([b.name[:12], b.name]))
    ratio = pair_ratio(a, extra, P)
    assert ratio is not None and ratio <= P.ratio


def test_params_and_calls_are_checked() -> None:
    for bad in ({"ratio": 1.0}, {"ratio": 0.0}, {"inside": 0.5}, {"outside": 0.5}, {"min_calls": 2},
                {"max_shift": -1}, {"groups": 1}, {"members": 0}, {"beyond": 0.5}, {"resolution_ns": 0.0},
                {"same_names": 0.4}):
        with pytest.raises(DetectorError):
            CoEndParams(**bad)  # type: ignore[arg-type]
    x = np.zeros(3, dtype=np.int64)
    with pytest.raises(DetectorError):
        StreamCalls(x, x[:2], x, x)


def test_calls_outside_every_step_are_left_out_where_both_ranks_have_steps() -> None:
    topo = build_topology("j", 2, 2, 1)
    calls = _calls(topo.array("tp_group"), np.random.default_rng(5))
    a, b = calls[0], calls[1]
    # Rank b's trace holds three calls before its first step (the previous step's tail), rank a's does not.
    tail = StreamCalls(np.concatenate([b.start_ns[:3] - 10**8, b.start_ns]),
                       np.concatenate([b.end_ns[:3] - 10**8, b.end_ns]),
                       np.concatenate([np.full(3, -1), b.step]), np.concatenate([b.name[:3], b.name]))
    ratio = pair_ratio(a, tail, P)
    assert ratio is not None and ratio <= P.ratio


def test_groups_that_start_together_and_end_together_are_no_larger_group() -> None:
    """The DP reduction after the last TP collective of the backward: the TP peers arrive at once, every DP
    group ends at the same last arrival, so ranks of different DP groups end together too -- having started
    together, which tells nothing of a group they share."""
    topo = build_topology("j", 4, 8, 1)
    tp = topo.array("tp_group")
    calls = _calls(topo.array("dp_group"), np.random.default_rng(6), arrive_with=tp * 8)  # a TP group's first
    assert stream_kind(calls, kind_pairs(topo, P), P) is ParallelGroup.DP
