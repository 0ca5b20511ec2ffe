"""Parallel layout of a training job in Megatron rank order, and lookups of its groups.

Ranks are numbered tensor-parallel fastest, then data-parallel, then pipeline-parallel::

    rank = tp_idx + tp * (dp_idx + dp * pp_idx)

so the ranks of one pipeline stage are the contiguous block ``[pp_idx * tp * dp, (pp_idx + 1) * tp * dp)``
and a TP group is ``tp`` consecutive ranks. Group indices (what :class:`~argus.schemas.records.JobTopology`
stores) are chosen so that ranks sharing an index of a kind form one group: see docs/internals/producers.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from argus.schemas.records import JobTopology, ParallelGroup

__all__ = ["GROUP_COLUMN", "build_topology", "group_index", "group_members", "groups_of", "parse_topology_spec",
           "stage_ranks", "topology_from_groups", "with_hosts"]

_SPEC_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep"}
_SPEC_ITEM = re.compile(r"^\s*([a-z]+)\s*[=:]\s*(\d+)\s*$")

#: The topology column holding each rank's group index of a kind.
GROUP_COLUMN: dict[ParallelGroup, str] = {
    ParallelGroup.DP: "dp_group",
    ParallelGroup.TP: "tp_group",
    ParallelGroup.PP: "pp_group",
    ParallelGroup.EP: "ep_group",
}


def build_topology(job_id: str, dp: int, tp: int = 1, pp: int = 1, ep: int = 1,
                   hosts_per_node: int = 8) -> JobTopology:
    """The topology of a ``dp * tp * pp`` rank job in Megatron order (see the module docstring).

    Args:
        job_id: training job identifier.
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees (each >= 1).
        ep: expert-parallel degree; must divide ``dp``.
        hosts_per_node: ranks (GPUs) per host.

    Raises:
        ValueError: a degree is < 1, ``ep`` does not divide ``dp``, or ``job_id`` is empty.
    """
    if not job_id:
        raise ValueError("job_id must not be empty")
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep), ("hosts_per_node", hosts_per_node)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    world = dp * tp * pp
    ranks = range(world)
    tp_idx = [r % tp for r in ranks]
    dp_idx = [(r // tp) % dp for r in ranks]
    pp_idx = [r // (tp * dp) for r in ranks]
    dp_group = [t + tp * p for t, p in zip(tp_idx, pp_idx, strict=True)]
    return JobTopology(
        job_id=job_id,
        world_size=world,
        dp_size=dp,
        tp_size=tp,
        pp_size=pp,
        ep_size=ep,
        rank=tuple(ranks),
        host=tuple(f"node{r // hosts_per_node:04d}" for r in ranks),
        dp_group=tuple(dp_group),
        tp_group=tuple(d + dp * p for d, p in zip(dp_idx, pp_idx, strict=True)),
        pp_group=tuple(t + tp * d for t, d in zip(tp_idx, dp_idx, strict=True)),
        ep_group=tuple(g * (dp // ep) + d // ep for g, d in zip(dp_group, dp_idx, strict=True)),
        pp_stage=tuple(pp_idx),
    )


def _column(topology: JobTopology, kind: ParallelGroup) -> tuple[int, ...]:
    try:
        return tuple(getattr(topology, GROUP_COLUMN[kind]))
    except KeyError:
        raise ValueError(f"{kind} is not a parallel group kind") from None


def group_index(topology: JobTopology, kind: ParallelGroup, rank: int) -> int:
    """The index of ``rank``'s group of ``kind``. Raises :class:`ValueError` for an unknown rank."""
    try:
        pos = topology.rank.index(rank)
    except ValueError:
        raise ValueError(f"rank {rank} is not in topology {topology.job_id}") from None
    return _column(topology, kind)[pos]


def group_members(topology: JobTopology, kind: ParallelGroup, group_index: int) -> list[int]:
    """The ranks (ascending) of group ``group_index`` of ``kind``; empty if there is no such group.

    For :attr:`ParallelGroup.PP` the ascending order is also the stage order.
    """
    column = _column(topology, kind)
    return sorted(r for r, g in zip(topology.rank, column, strict=True) if g == group_index)


def groups_of(topology: JobTopology, kind: ParallelGroup) -> dict[int, list[int]]:
    """Every group of ``kind``: ``{group index: ascending member ranks}``, ordered by index."""
    out: dict[int, list[int]] = {}
    for r, g in zip(topology.rank, _column(topology, kind), strict=True):
        out.setdefault(g, []).append(r)
    return {g: sorted(members) for g, members in sorted(out.items())}


def stage_ranks(topology: JobTopology, stage: int) -> list[int]:
    """The ranks (ascending) of pipeline stage ``stage``."""
    return sorted(r for r, s in zip(topology.rank, topology.pp_stage, strict=True) if s == stage)


def parse_topology_spec(spec: str) -> dict[str, int]:
    """The degrees of ``ARGUS_TOPOLOGY``-style text: ``"dp=4,tp=2,pp=1"`` -> ``{"dp": 4, "tp": 2, "pp": 1}``.

    Items are separated by commas (or semicolons / spaces); keys are ``dp``, ``tp``, ``pp``, ``ep``
    (case-insensitive); missing ones are left out (the caller's defaults apply).

    Raises:
        ValueError: an unknown key, a repeated key, a value < 1 or text that is not ``key=integer``.
    """
    out: dict[str, int] = {}
    for item in re.split(r"[,; ]+", spec.strip().lower()):
        if not item:
            continue
        m = _SPEC_ITEM.match(item)
        if m is None or m.group(1) not in _SPEC_KEYS:
            raise ValueError(f"topology item {item!r} is not one of dp=N, tp=N, pp=N, ep=N (in {spec!r})")
        key, value = _SPEC_KEYS[m.group(1)], int(m.group(2))
        if key in out:
            raise ValueError(f"topology key {key!r} given twice in {spec!r}")
        if value < 1:
            raise ValueError(f"topology degree {key}={value} must be >= 1")
        out[key] = value
    return out


def with_hosts(topology: JobTopology, hosts: Sequence[str]) -> JobTopology:
    """``topology`` with the host of each rank (position by position). Raises ValueError on a length mismatch."""
    if len(hosts) != topology.world_size:
        raise ValueError(f"{len(hosts)} hosts for {topology.world_size} ranks")
    return dataclasses.replace(topology, host=tuple(str(h) for h in hosts))


def _complete(world_size: int, groups: dict[ParallelGroup, list[list[int]]]) -> None:
    """Derive the DP, TP or PP groups left out of ``groups`` (in place): with none given, one DP group of all
    ranks; else one group per rank when the given kinds already multiply to the world size, else the ranks
    holding the same positions in the other kinds' groups (the complement, as in any ``dp x tp x pp`` grid)."""
    grid = (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP)
    for kind in grid:
        if kind in groups:
            continue
        known = [k for k in grid if k in groups]
        size = 1
        for k in known:
            size *= len(groups[k][0]) if groups[k] else 1
        if not known:  # nothing given: pure data parallelism
            groups[kind] = [list(range(world_size))] if kind is ParallelGroup.DP else [[r] for r in range(world_size)]
            continue
        if size == world_size:
            groups[kind] = [[r] for r in range(world_size)]
            continue
        position: dict[ParallelGroup, dict[int, int]] = {
            k: {r: i for g in groups[k] for i, r in enumerate(sorted(g))} for k in known}
        by_key: dict[tuple[int, ...], list[int]] = {}
        for r in range(world_size):
            by_key.setdefault(tuple(position[k].get(r, -1) for k in known), []).append(r)
        groups[kind] = list(by_key.values())


def topology_from_groups(job_id: str, world_size: int, groups: Mapping[ParallelGroup, Sequence[Sequence[int]]],
                         hosts: Sequence[str] | None = None, hosts_per_node: int = 8) -> JobTopology:
    """The topology of a job described by its process groups' members (any rank order).

    Args:
        groups: per kind (DP, TP, PP, EP), its groups as lists of global ranks; together the groups of a kind
            must cover every rank exactly once, all of one size. A DP, TP or PP kind left out is derived (none
            given: pure DP; else one group per rank when the others already multiply to the world size, else
            their complement: the ranks at the same positions in the other kinds' groups); EP left out is
            degree 1. A PP group's ranks
            in ascending order are its stages.
        hosts: the host of each rank (default ``node0000``-style names, ``hosts_per_node`` ranks each).

    Group indices are numbered by each group's lowest rank. Raises ValueError when the groups of a kind do not
    partition ``range(world_size)`` into equal sizes, or when ``dp * tp * pp != world_size``.
    """
    if not job_id or world_size < 1:
        raise ValueError(f"invalid job_id {job_id!r} or world_size {world_size}")
    given: dict[ParallelGroup, list[list[int]]] = {
        k: [sorted({int(r) for r in g}) for g in v if len(g)] for k, v in groups.items() if v}
    _complete(world_size, given)
    columns: dict[ParallelGroup, list[int]] = {}
    sizes: dict[ParallelGroup, int] = {}
    stage = [0] * world_size
    for kind in (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.EP):
        members = sorted(given.get(kind) or [[r] for r in range(world_size)], key=lambda m: m[0])
        seen = [r for m in members for r in m]
        if sorted(seen) != list(range(world_size)):
            raise ValueError(f"the {kind.value} groups do not cover ranks 0..{world_size - 1} once each")
        if len({len(m) for m in members}) != 1:
            raise ValueError(f"the {kind.value} groups are not all of one size: {sorted({len(m) for m in members})}")
        col = [0] * world_size
        for i, m in enumerate(members):
            for pos, r in enumerate(m):
                col[r] = i
                if kind is ParallelGroup.PP:
                    stage[r] = pos
        columns[kind], sizes[kind] = col, len(members[0])
    dp, tp, pp = sizes[ParallelGroup.DP], sizes[ParallelGroup.TP], sizes[ParallelGroup.PP]
    if dp * tp * pp != world_size:
        raise ValueError(f"dp={dp} * tp={tp} * pp={pp} != world size {world_size}")
    host = tuple(hosts) if hosts is not None else tuple(f"node{r // max(1, hosts_per_node):04d}"
                                                          for r in range(world_size))
    if len(host) != world_size:
        raise ValueError(f"{len(host)} hosts for {world_size} ranks")
    return JobTopology(job_id=job_id, world_size=world_size, dp_size=dp, tp_size=tp, pp_size=pp,
                       ep_size=sizes[ParallelGroup.EP], rank=tuple(range(world_size)), host=host,
                       dp_group=tuple(columns[ParallelGroup.DP]), tp_group=tuple(columns[ParallelGroup.TP]),
                       pp_group=tuple(columns[ParallelGroup.PP]), ep_group=tuple(columns[ParallelGroup.EP]),
                       pp_stage=tuple(stage))
