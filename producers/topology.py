"""Parallel layout of a training job in Megatron rank order, and lookups of its groups.

Ranks are numbered tensor-parallel fastest, then data-parallel, then pipeline-parallel::

    rank = tp_idx + tp * (dp_idx + dp * pp_idx)

so the ranks of one pipeline stage are the contiguous block ``[pp_idx * tp * dp, (pp_idx + 1) * tp * dp)``
and a TP group is ``tp`` consecutive ranks. Group indices (what :class:`~schemas.records.JobTopology`
stores) are chosen so that ranks sharing an index of a kind form one group:

=============  ====================================  =============================================
column         members share                          index
=============  ====================================  =============================================
``tp_group``   ``(dp_idx, pp_idx)``                   ``dp_idx + dp * pp_idx`` (= rank // tp)
``dp_group``   ``(tp_idx, pp_idx)``                   ``tp_idx + tp * pp_idx``
``pp_group``   ``(tp_idx, dp_idx)`` (one pipeline)    ``tp_idx + tp * dp_idx``
``ep_group``   DP group and ``dp_idx // ep``          ``dp_group * (dp // ep) + dp_idx // ep``
``pp_stage``   ``pp_idx``                             ``pp_idx`` (0 = first stage)
=============  ====================================  =============================================

Expert-parallel groups partition every DP group into ``dp // ep`` chunks of ``ep`` consecutive DP ranks
(``ep`` must divide ``dp``), as Megatron carves the expert-parallel group out of the data-parallel one.
Hosts hold ``hosts_per_node`` consecutive ranks each (the number of GPUs, i.e. ranks, per host) and are
named ``node0000``, ``node0001``, ...
"""

from __future__ import annotations

from schemas.records import JobTopology, ParallelGroup

__all__ = ["build_topology", "group_index", "group_members", "groups_of", "stage_ranks"]

_COLUMN = {
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
        return tuple(getattr(topology, _COLUMN[kind]))
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
