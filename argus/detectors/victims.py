"""Causes and victims: the rules by which a late or slow rank is told from the ranks that waited for it.

In a synchronous job one slow rank makes others wait, and waiting looks like slowness: a member that
reaches a collective last is late, a member that waited is long in it (how much shorter a late arrival's
collective is: ``late_arrival_ratio`` of L2's and the links' Params). These rules, used by L2, L3 and the
stream layer alike, live here once: which late ranks only waited for a straggler
(:func:`waiting_victims`), which ranks the findings name stragglers (:func:`straggler_ranks`), and which
findings are then a straggler's victims or its own evidence (:func:`drop_victims`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from argus.core.kinds import FindingKind
from argus.detectors.phase_layout import BLOCKING_GROUPS
from argus.schemas.records import Finding, JobTopology, ParallelGroup

__all__ = ["drop_victims", "straggler_ranks", "waiting_victims"]

#: Findings that name a rank slow by its own work.
_STRAGGLER_KINDS = frozenset({FindingKind.COMPUTE_STRAGGLER, FindingKind.RANK_DEGRADED})


def waiting_victims(stragglers: set[int], late: set[int], topology: JobTopology,
                    groups: Iterable[ParallelGroup] = BLOCKING_GROUPS) -> set[int]:
    """The ``late`` arrivals that waited for a straggler: those sharing a TP, PP or EP group (``groups``)
    with one of ``stragglers`` (e.g. its TP partner, held up in their blocking TP all-reduce and so late to
    its DP all-reduce), then those sharing one with such a victim (e.g. the victim's next pipeline stage),
    and so on. A shared DP group is no link: the DP all-reduce ends the step, nothing waits behind it.
    ``stragglers`` themselves are never victims."""
    candidates = late - stragglers
    if not candidates or not stragglers:
        return set()
    columns = [topology.array(g.column) for g in sorted(set(groups), key=lambda g: g.value)]
    # One pass per round over the candidates' group ids (thousands of late ranks in a 10k-rank job wait
    # behind one straggler): a candidate is reached when one of its groups holds a rank of the frontier.
    rank = np.fromiter(candidates, dtype=np.int64, count=len(candidates))
    at, known = topology.positions(rank)
    rank, at = rank[known], at[known]
    frontier, known = topology.positions(np.fromiter(stragglers, dtype=np.int64, count=len(stragglers)))
    frontier = frontier[known]
    reached = np.zeros(rank.size, dtype=bool)
    while frontier.size and not reached.all():
        new = np.zeros(rank.size, dtype=bool)
        for col in columns:
            new |= np.isin(col[at], col[frontier])
        new &= ~reached
        reached |= new
        frontier = at[new]
    return set(rank[reached].tolist())


def straggler_ranks(findings: list[Finding]) -> set[int]:
    """Ranks named compute stragglers: by L2 (phases) or by L3 across kernels (``rank_degraded``)."""
    return {r for f in findings if f.kind in _STRAGGLER_KINDS for r in f.ranks}


def drop_victims(findings: list[Finding], stragglers: set[int]) -> list[Finding]:
    """Keep L3 late-arrival findings only for ranks L2 named compute stragglers (``stragglers``), and drop
    per-kernel findings of ranks already named stragglers.

    A member that reaches a collective last is late, not necessarily the cause: a rank sharing a blocking
    group (TP, PP or EP: collectives inside the layer) with a straggler waits for it there and reaches its
    *other* collectives late as well, and so does a pipeline stage waiting for another. A single (kernel,
    stream) cannot tell why; L2 (the phases of every group) and the compute kernels can, so an L3 late
    arrival is only raised as corroboration of a straggler found there. A straggler's slower kernels are
    its finding's evidence already; raised one by one, the smallest of them would come and go with the
    noise of their impact.
    """
    return [f for f in findings
            if not (f.kind is FindingKind.LATE_ARRIVAL and not set(f.ranks) <= stragglers)
            and not (f.kind is FindingKind.KERNEL_DEGRADED and set(f.ranks) <= stragglers)]

