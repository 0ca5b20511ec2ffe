"""Megatron-order topology: group membership, sizes and helpers."""

from __future__ import annotations

import pytest

from argus.producers.topology import build_topology, group_index, group_members, groups_of, stage_ranks
from argus.schemas.records import JobTopology, ParallelGroup


def _sets(topo: JobTopology, kind: ParallelGroup) -> set[frozenset[int]]:
    return {frozenset(m) for m in groups_of(topo, kind).values()}


def test_2x2x2_groups() -> None:
    topo = build_topology("j", dp=2, tp=2, pp=2)
    assert topo.world_size == 8 and (topo.dp_size, topo.tp_size, topo.pp_size) == (2, 2, 2)
    assert _sets(topo, ParallelGroup.TP) == {frozenset(s) for s in ({0, 1}, {2, 3}, {4, 5}, {6, 7})}
    assert _sets(topo, ParallelGroup.DP) == {frozenset(s) for s in ({0, 2}, {1, 3}, {4, 6}, {5, 7})}
    assert _sets(topo, ParallelGroup.PP) == {frozenset(s) for s in ({0, 4}, {1, 5}, {2, 6}, {3, 7})}
    assert topo.pp_stage == (0, 0, 0, 0, 1, 1, 1, 1)
    assert stage_ranks(topo, 1) == [4, 5, 6, 7]


def test_8x1x1_is_one_dp_group() -> None:
    topo = build_topology("j", dp=8)
    assert groups_of(topo, ParallelGroup.DP) == {0: list(range(8))}
    assert len(groups_of(topo, ParallelGroup.TP)) == 8
    assert set(topo.pp_stage) == {0}
    assert group_members(topo, ParallelGroup.DP, 0) == list(range(8))
    assert group_members(topo, ParallelGroup.DP, 1) == []


def test_4x2x4_sizes_and_membership() -> None:
    dp, tp, pp = 4, 2, 4
    topo = build_topology("j", dp=dp, tp=tp, pp=pp)
    assert topo.world_size == 32
    for kind, count, size in ((ParallelGroup.DP, tp * pp, dp), (ParallelGroup.TP, dp * pp, tp),
                              (ParallelGroup.PP, tp * dp, pp)):
        groups = groups_of(topo, kind)
        assert len(groups) == count and all(len(m) == size for m in groups.values())
        assert sorted(r for m in groups.values() for r in m) == list(range(32))
    for r in range(32):
        tp_idx, dp_idx, pp_idx = r % tp, (r // tp) % dp, r // (tp * dp)
        assert r == tp_idx + tp * (dp_idx + dp * pp_idx)
        assert topo.pp_stage[r] == pp_idx
        for peer in group_members(topo, ParallelGroup.DP, topo.dp_group[r]):
            assert peer % tp == tp_idx and topo.pp_stage[peer] == pp_idx
        for peer in group_members(topo, ParallelGroup.TP, topo.tp_group[r]):
            assert peer // tp == r // tp
    pipeline = group_members(topo, ParallelGroup.PP, topo.pp_group[5])
    assert [topo.pp_stage[p] for p in pipeline] == [0, 1, 2, 3]
    assert group_index(topo, ParallelGroup.TP, 5) == 2


def test_ep_partitions_dp_groups() -> None:
    topo = build_topology("j", dp=8, ep=4)
    assert _sets(topo, ParallelGroup.EP) == {frozenset(range(4)), frozenset(range(4, 8))}
    topo = build_topology("j", dp=4, tp=2, ep=2)
    for members in groups_of(topo, ParallelGroup.EP).values():
        assert len(members) == 2
        assert len({topo.dp_group[m] for m in members}) == 1
    assert topo.ep_size == 2


def test_hosts_and_roundtrip() -> None:
    topo = build_topology("job-x", dp=4, tp=2, hosts_per_node=4)
    assert topo.host[:5] == ("node0000",) * 4 + ("node0001",)
    assert JobTopology.decode(topo.encode()) == topo


@pytest.mark.parametrize("kwargs", [{"dp": 0}, {"dp": 6, "ep": 4}, {"dp": 2, "tp": 0}])
def test_invalid(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        build_topology("j", **kwargs)


def test_none_kind_rejected() -> None:
    with pytest.raises(ValueError):
        groups_of(build_topology("j", dp=2), ParallelGroup.NONE)


def test_columns_as_arrays_are_read_only_and_made_once() -> None:
    topo = build_topology("j", dp=4, tp=2, pp=2)
    dp = topo.array("dp_group")
    assert dp.tolist() == list(topo.dp_group) and dp.dtype.name == "int64"
    assert topo.array("dp_group") is dp
    with pytest.raises(ValueError):
        dp[0] = 1
    assert topo == build_topology("j", dp=4, tp=2, pp=2)  # the cache is no field: equality is unchanged


@pytest.mark.parametrize("ranks", [(3, 0, 2, 1), (0, 1, 2, 3), (5, 5, 1, 9), ()])
def test_positions_of_ranks_and_whether_they_are_there(ranks: tuple[int, ...]) -> None:
    n, each = len(ranks), tuple(range(len(ranks)))
    topo = JobTopology("j", n, 1, 1, 1, ranks, ("h",) * n, (0,) * n, each, each, each, (0,) * n)
    want = [9, 5, 3, 0, 1, 4, -2]
    at, found = topo.positions(want)
    last = {r: i for i, r in enumerate(ranks)}  # the last of equal ranks
    assert found.tolist() == [r in last for r in want]
    assert [int(a) for a, f in zip(at, found, strict=True) if f] == [last[r] for r in want if r in last]
