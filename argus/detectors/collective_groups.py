"""The parallel groups a collective kernel is read in, from the job's topology (pure numerics).

A collective ends together on every member of its group, so L3 reads a collective's durations group by
group (:func:`~argus.detectors.l3_kernels.detect_l3`, the link rule :mod:`argus.detectors.links`): the
reductions and gathers in data- and tensor-parallel groups, send/receive kernels in pipeline pairs (adjacent
stages) and expert groups (NCCL runs an all-to-all as grouped sends and receives), and a stream that skips a
pipeline stage rank by rank, each rank one side of its pipeline transfers
(:attr:`~argus.detectors.links.PseudoGroup.PP_SIDE`). A pipeline pair's or side's index is
``pp_group * 65536 + stage``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from argus.detectors.l2_phases import rank_positions
from argus.detectors.links import Group, PseudoGroup
from argus.schemas.records import JobTopology, ParallelGroup

__all__ = ["collective_groups", "collective_kinds", "is_p2p"]

I64 = npt.NDArray[np.int64]
#: The kinds reductions and gathers run in (send/receive kernels run in pipeline and expert groups).
_REDUCTION_KINDS = (ParallelGroup.DP, ParallelGroup.TP)


def is_p2p(kernel: str) -> bool:
    """Point-to-point kernels (NCCL's ``SendRecv``, ``Send``, ``Recv``): pipeline transfers, or an all-to-all
    (NCCL runs it as grouped send/receive)."""
    low = kernel.lower()
    return "send" in low or "recv" in low


def collective_groups(topology: JobTopology | None, ranks: I64, p2p: bool,
                      only: ParallelGroup | None = None) -> list[Group]:
    """(kind, index, rows) of every group whose members are all present (2+), largest first; the job without
    topology.

    Point-to-point kernels run in pipeline groups, as adjacent-stage pairs (a send/receive joins two stages),
    and in expert groups (all-to-all); collectives in DP, TP and EP groups."""
    if topology is None:
        return [(PseudoGroup.JOB, 0, np.arange(ranks.size))]
    at = rank_positions(topology, ranks)
    # NCCL runs an all-to-all as grouped sends and receives, so expert groups show in point-to-point kernels
    # only; the reductions and gathers run in data- and tensor-parallel groups.
    if only is not None and only is not ParallelGroup.NONE:
        kinds: tuple[ParallelGroup, ...] = (only,)
    elif p2p and _one_side(topology, at):
        kinds = (ParallelGroup.PP,)
    else:
        kinds = (ParallelGroup.PP, ParallelGroup.EP) if p2p else _REDUCTION_KINDS
    out: list[Group] = []
    for kind in kinds:
        column = topology.array(kind.column)
        full = dict(zip(*np.unique(column, return_counts=True), strict=True))
        uniq, inv, counts = np.unique(column[at], return_inverse=True, return_counts=True)
        members = np.split(np.argsort(inv, kind="stable"), np.cumsum(counts)[:-1])
        # Only groups with every member present: in a window cut between the members' arrivals, a group
        # missing its late member would look uniformly slow (a false link) or name a waiting member late.
        whole = [(int(g), rows) for g, rows in zip(uniq.tolist(), members, strict=True)
                 if rows.size >= 2 and rows.size == full[g]]
        if kind is ParallelGroup.PP:
            stage = topology.array("pp_stage")[at]
            for g, rows in whole:
                chain = rows[np.argsort(stage[rows], kind="stable")]
                out += [(kind, g * 65536 + i, chain[i:i + 2]) for i in range(chain.size - 1)]
            if p2p and not whole:
                out += _pipeline_sides(column[at], stage)
        else:
            out += [(kind, g, rows) for g, rows in whole]
    out.sort(key=lambda t: -t[2].size)
    return out


def collective_kinds(topology: JobTopology) -> int:
    """How many of the kinds a collective (no send/receive) runs in -- DP and TP -- have groups of 2 or more
    ranks in ``topology``: with one, a collective's grouping is not a guess among several."""
    return sum(int(np.unique(topology.array(kind.column), return_counts=True)[1].max(initial=0) >= 2)
               for kind in _REDUCTION_KINDS)


def _one_side(topology: JobTopology, at: I64) -> bool:
    """Whether point-to-point calls on the ranks at positions ``at`` of ``topology`` are pipeline transfers
    seen one side per stream: they run on some pipeline stages but not all (the sends to the next stage
    skip the last, the receives from the previous one skip the first). An all-to-all runs in every stage
    with expert layers, so such a stream is no expert group's: read as one, the stage that waits longest
    for its neighbour (the first, in a pipeline's warm-up) would look like a slow expert group."""
    stages = topology.array("pp_stage")
    return bool(np.unique(stages).size > np.unique(stages[at]).size)


def _pipeline_sides(pp_group: I64, stage: I64) -> list[Group]:
    """Each rank on its own, as one side of its pipeline transfers: a stream that carries one side only (the
    sends to the next stage and the receives from it are on one communicator's stream, the other stage's
    on another) has no whole pair. Index: ``pp_group * 65536 + stage``."""
    return [(PseudoGroup.PP_SIDE, int(pp_group[i]) * 65536 + int(stage[i]), np.array([i], dtype=np.int64))
            for i in range(pp_group.size)]
