"""The parallel group of each collective phase in a torch.profiler trace, and role names for transfers.

Two things in a trace tell which group a communication phase ran in: see docs/internals/producers.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

from argus.detectors.co_ending import CoEndParams, StreamCalls, co_ending_kinds, kind_pairs, sampled_ranks
from argus.producers.kineto_parse import RankTrace, StreamPG, assign_steps
from argus.producers.topology import GROUP_COLUMN
from argus.schemas.records import JobTopology, ParallelGroup, PhaseKind

__all__ = ["MAX_STREAM_CALLS", "MEGATRON_GROUPS", "PhaseGroups", "co_ended_streams", "stream_calls"]

_P2P = re.compile(r"^nccl:(send|recv)\s*(\d+)\s*(?:->|<-)\s*(\d+)\s*$")
#: Megatron's process-group descriptions (``pg_config`` ``pg_desc``) of the groups argus compares in.
MEGATRON_GROUPS: Mapping[str, ParallelGroup] = {
    "TENSOR_MODEL_PARALLEL_GROUP": ParallelGroup.TP,
    "DATA_PARALLEL_GROUP": ParallelGroup.DP,
    "PIPELINE_MODEL_PARALLEL_GROUP": ParallelGroup.PP,
    "EXPERT_MODEL_PARALLEL_GROUP": ParallelGroup.EP,
}

_KINDS = (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.EP)
#: NCCL calls kept per (rank, stream) for the co-ending test, the earliest: enough to judge a pair by, and a
#: bound on memory whatever the traces' length.
MAX_STREAM_CALLS = 2048
_READ_ROWS = 1 << 16


def stream_calls(trace: RankTrace, name_ids: dict[str, int], limit: int = MAX_STREAM_CALLS) -> dict[int, StreamCalls]:
    """Per CUDA stream of ``trace``: its NCCL kernels (``ncclKernel_*``,
    ``ncclDevKernel_*``), the earliest ``limit`` by start, with their steps; ``name_ids`` maps kernel names to
    ids shared by every rank (new names are added)."""
    nccl = np.array([i for i, n in enumerate(trace.names) if n.lower().startswith("nccl")], dtype=np.int64)
    if not nccl.size:
        return {}
    local = np.full(len(trace.names), -1, dtype=np.int64)
    local[nccl] = [name_ids.setdefault(trace.names[i], len(name_ids)) for i in nccl.tolist()]
    parts: dict[int, list[npt.NDArray[np.int64]]] = {}
    kept: dict[int, int] = {}
    for rows in trace.rows(_READ_ROWS):
        sel = np.isin(rows["name"], nccl)
        for st in np.unique(rows["stream"][sel]).tolist():
            if kept.get(st, 0) >= 4 * limit:  # file order is nearly start order: later calls are not the earliest
                continue
            r = rows[sel & (rows["stream"] == st)]
            parts.setdefault(st, []).append(np.stack([r["start"], r["start"] + r["dur"], local[r["name"]]]))
            kept[st] = kept.get(st, 0) + r.shape[0]
    iv = trace.intervals(gpu=True)
    out = {}
    for st, chunks in parts.items():
        cols = np.concatenate(chunks, axis=1)
        cols = cols[:, np.argsort(cols[0], kind="stable")[:limit]]
        out[int(st)] = StreamCalls(cols[0], cols[1], assign_steps(iv, cols[0]).astype(np.int64), cols[2])
    return out


def co_ended_streams(topology: JobTopology, traces: Iterable[RankTrace], skip: Iterable[int] = (),
                     params: CoEndParams | None = None) -> dict[int, ParallelGroup]:
    """Per NCCL stream (but those in ``skip``: already known), the kind of group its collectives run in, by
    which ranks' calls end together (:func:`argus.detectors.co_ending.co_ending_kinds`); only the ranks the
    test samples are read."""
    p = params if params is not None else CoEndParams()
    want = sampled_ranks(kind_pairs(topology, p))
    name_ids: dict[str, int] = {}
    by_stream: dict[int, dict[int, StreamCalls]] = {}
    known = set(skip)
    for t in traces:
        if t.rank in want:
            for st, calls in stream_calls(t, name_ids).items():
                if st not in known:
                    by_stream.setdefault(st, {})[t.rank] = calls
    return co_ending_kinds(by_stream, topology, p)


class PhaseGroups:
    """Names and groups of one job's communication phases (see the module docstring).

    Groups are found on demand, for the ranks that ask (an import of a few ranks' traces of a large world
    builds nothing per rank of the world): each kind's column is sorted once, a group is a slice of it.
    """

    def __init__(self, topology: JobTopology) -> None:
        self._topo = topology
        self._stages = topology.array("pp_stage")
        #: kind -> (member ranks ordered by group index, their group indexes in that order, each rank's index).
        self._sorted: dict[ParallelGroup, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                                 npt.NDArray[np.int64]]] = {}
        self._groups: dict[tuple[ParallelGroup, int], frozenset[int]] = {}
        self._ep = topology.ep_size > 1

    def _stage(self, rank: int) -> int | None:
        """``rank``'s pipeline stage, or None when the topology does not have it."""
        pos, found = self._topo.positions([rank])
        return int(self._stages[pos[0]]) if found[0] else None

    def _group(self, kind: ParallelGroup, rank: int) -> frozenset[int]:
        """The members of ``rank``'s group of ``kind`` (``rank`` must be in the topology)."""
        cols = self._sorted.get(kind)
        if cols is None:
            column = self._topo.array(GROUP_COLUMN[kind])
            order = np.argsort(column, kind="stable")
            cols = self._sorted[kind] = (self._topo.array("rank")[order], column[order], column)
        members, indexes, column = cols
        pos, _ = self._topo.positions([rank])
        g = int(column[pos[0]])
        group = self._groups.get((kind, g))
        if group is None:
            lo, hi = np.searchsorted(indexes, [g, g + 1])
            group = self._groups[(kind, g)] = frozenset(members[lo:hi].tolist())
        return group

    def stream_groups(self) -> dict[int, ParallelGroup]:
        """The group kinds of the collective streams the topology knows (``group_streams``)."""
        return self._topo.stream_groups()

    def stream_group(self, rank: int, pg: StreamPG) -> ParallelGroup:
        """The kind of ``rank``'s group that ``pg`` is: by its Megatron description, else by its ranks (the
        first kind whose group of ``rank`` has exactly those members); NONE when neither tells."""
        by_desc = MEGATRON_GROUPS.get(pg.desc.strip().upper())
        if by_desc is not None:
            return by_desc
        if self._stage(rank) is None or len(pg.ranks) < 2:
            return ParallelGroup.NONE
        members = frozenset(pg.ranks)
        return next((kind for kind in _KINDS if self._group(kind, rank) == members), ParallelGroup.NONE)

    def phase(self, rank: int, name: str, kind: PhaseKind, stream_group: ParallelGroup) -> tuple[str, ParallelGroup]:
        """The name and group kind of ``rank``'s phase ``name`` of ``kind``; ``stream_group``: the group of the
        stream it ran on (:meth:`stream_group`, NONE if unknown or on the host)."""
        m = _P2P.match(name)
        if m is not None:
            renamed = self._p2p(rank, m.group(1), int(m.group(2)), int(m.group(3)))
            if renamed is not None:
                return renamed
        if kind.is_collective and stream_group is not ParallelGroup.NONE:
            return name, stream_group
        return name, ParallelGroup.NONE

    def _p2p(self, rank: int, op: str, a: int, b: int) -> tuple[str, ParallelGroup] | None:
        stage = self._stage(rank)
        if stage is None:
            return None
        pipe = self._group(ParallelGroup.PP, rank)
        peer_stage = self._stage(b) if a == rank else None
        if peer_stage is not None:  # global ranks
            if b in pipe and abs(peer_stage - stage) == 1:
                return f"nccl:{op} {'next' if peer_stage > stage else 'prev'}", ParallelGroup.PP
            if self._ep and b in self._group(ParallelGroup.EP, rank):
                return f"nccl:{op} ep", ParallelGroup.EP
        if a == stage and abs(b - stage) == 1 and any(self._stage(r) == b for r in pipe):  # the pipeline's ranks
            return f"nccl:{op} {'next' if b > stage else 'prev'}", ParallelGroup.PP
        return None
