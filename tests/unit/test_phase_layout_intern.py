"""Decoded PhaseBatch records share the tuples of equal layouts (schemas.records._LayoutCache), with values and
equality unchanged; JobDiagnosis learns collective groups from decoded records as from shared ones."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from argus.producers.topology import build_topology
from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind, _LayoutCache
from argus.streams.diagnosis import JobDiagnosis

KINDS = [k.value for k in PhaseKind]
GROUPS = [g.value for g in ParallelGroup]


def _batch(rank: int, names: tuple[str, ...], kinds: tuple[PhaseKind, ...], groups: tuple[ParallelGroup, ...],
           streams: tuple[int, ...], step: int = 0) -> PhaseBatch:
    n = len(names)
    return PhaseBatch("j", rank, step, kinds, names, groups, streams, tuple(range(100, 100 + 10 * n, 10)),
                      tuple(range(1, n + 1)))


layouts = st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.text(max_size=4), min_size=n, max_size=n).map(tuple),
    st.lists(st.sampled_from(list(PhaseKind)), min_size=n, max_size=n).map(tuple),
    st.lists(st.sampled_from(list(ParallelGroup)), min_size=n, max_size=n).map(tuple),
    st.lists(st.integers(-1, 40), min_size=n, max_size=n).map(tuple)))


@settings(max_examples=60, deadline=None)
@given(st.lists(layouts, min_size=1, max_size=5), st.lists(st.integers(0, 4), min_size=1, max_size=20))
def test_decoded_batches_equal_and_share_equal_layouts(pool: list[tuple], picks: list[int]) -> None:
    batches = [_batch(i, *pool[p % len(pool)]) for i, p in enumerate(picks)]
    decoded = [PhaseBatch.decode(b.encode()) for b in batches]
    assert decoded == batches
    for b, d in zip(batches, decoded, strict=True):
        assert all(type(x) is type(y) for x, y in zip(dataclasses.astuple(b), dataclasses.astuple(d), strict=True))
        assert all(isinstance(k, PhaseKind) for k in d.kinds) and all(isinstance(g, ParallelGroup) for g in d.groups)
    for a, b in itertools.pairwise(decoded):
        same = (a.names, a.kinds, a.groups, a.streams) == (b.names, b.kinds, b.groups, b.streams)
        assert (a.names is b.names and a.kinds is b.kinds and a.groups is b.groups and a.streams is b.streams) == same
        assert a.start_ns is not b.start_ns or a.start_ns == ()


def test_cache_is_bounded_and_forgets_the_oldest() -> None:
    cache = _LayoutCache(2)
    first = cache.intern(["FORWARD"], ["a"], ["NONE"], [7])
    assert cache.intern(["FORWARD"], ["a"], ["NONE"], [7]) is first
    cache.intern(["FORWARD"], ["b"], ["NONE"], [7])
    cache.intern(["FORWARD"], ["c"], ["NONE"], [7])
    again = cache.intern(["FORWARD"], ["a"], ["NONE"], [7])
    assert again == first and again is not first
    assert again == ((PhaseKind.FORWARD,), ("a",), (ParallelGroup.NONE,), (7,))
    assert cache.intern(["FORWARD"], ["a"], ["NONE"], [8])[3] == (8,)  # streams are part of the layout


def test_collective_groups_learnt_from_decoded_as_from_shared() -> None:
    topo = build_topology("j", 1, 2, 2)
    names = ("fwd", "tp-ar", "dp-ar", "pp")
    kinds = (PhaseKind.FORWARD, PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE, PhaseKind.SEND_RECV)
    layouts = [(names, kinds, (ParallelGroup.NONE, ParallelGroup.TP, ParallelGroup.DP, ParallelGroup.PP),
                (7, 17 + r % 2, 19, 21 + r)) for r in range(topo.world_size)]
    got = []
    for decode in (False, True):
        jd = JobDiagnosis("j")
        for step in range(3):
            for r in range(topo.world_size):
                b = _batch(r, *layouts[r], step=step)
                jd.add(PhaseBatch.decode(b.encode()) if decode else b)
        got.append(jd.collective_groups)
    assert got[0] == got[1] == {17: ParallelGroup.TP, 18: ParallelGroup.TP, 19: ParallelGroup.DP,
                                21: ParallelGroup.PP, 22: ParallelGroup.PP, 23: ParallelGroup.PP, 24: ParallelGroup.PP}
