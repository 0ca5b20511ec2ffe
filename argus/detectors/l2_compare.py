"""L2's comparison of ranks within their groups, one phase at a time, every group of the phase at once
(:mod:`argus.detectors.l2_phases` describes what is compared and why).

A phase's ranks are sorted by group; the groups of one size form a ``groups x members`` array and every
statistic (leave-one-out medians, medians, MADs, CVs) is taken along its rows, the same values a loop over
the groups gives (ten thousand ranks make thousands of TP or PP groups per phase).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from argus.detectors.l2_groups import MAD_SCALE, loo_median_rows, row_spreads
from argus.schemas.records import PhaseKind

if TYPE_CHECKING:
    from argus.detectors.l2_phases import L2Params

__all__ = ["Flag", "compare_rows", "pair_outliers", "phase_flags"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
#: Times are integer nanoseconds: a phase's time per step below one is no time measured, and a ratio to it
#: is no ratio (a member whose collective took "0 ns" arrived last, by at most its peers' time).
_RESOLUTION_NS = 1.0


def pair_outliers(value: F64, p: L2Params) -> tuple[F64, npt.NDArray[np.bool_]]:
    """Of two-member groups (``value``: one row per group, per-occurrence times), each pair's difference as a
    robust z against the other pairs' (``|a - b|`` over 1.4826 times the median of the others', floored at
    ``p.mad_floor`` of the row's median time), and which pairs stand out: z at least ``p.pair_min_z`` and the
    Bonferroni bar of a two-sided normal test at ``p.pairs_alpha`` over the rows.

    Within a pair there is no peer to score a member against: persistent speed differences of a few percent
    between GPUs make one member of some pair arrive last every step, its collective several times shorter
    than its partner's when the transfer is short. Only a pair whose difference stands out among the phase's
    pairs holds a straggler. With fewer than ``p.min_pairs`` rows every pair stands out (z is NaN).
    """
    rows = value.shape[0]
    if rows < p.min_pairs:
        return np.full(rows, np.nan), np.ones(rows, dtype=bool)
    diff = np.abs(value[:, 0] - value[:, 1])
    with np.errstate(invalid="ignore", divide="ignore"):
        others = loo_median_rows(diff[None, :])[0]  # a straggler's own pair does not widen its scale
        scale = np.maximum(MAD_SCALE * others, p.mad_floor * np.nanmedian(value, axis=1))
        z = diff / scale
    bar = max(p.pair_min_z, NormalDist().inv_cdf(1.0 - p.pairs_alpha / (2 * rows)))
    return z, np.nan_to_num(z, nan=0.0) >= bar


@dataclass
class Flag:
    """One rank's phase judged elevated (or, for a collective, short) against its group's other members."""

    rank: int
    phase: str
    kind: PhaseKind
    ratio: float
    z: float | None
    value_ns: float
    peers_ns: float
    cv: float
    group: str
    late_fraction: float = 0.0
    waited_fraction: float = 0.0
    #: Per step: time beyond the peers' median (compute), or lateness (collectives), ns.
    excess_ns: float = 0.0


def compare_rows(value: F64, p: L2Params, collective: bool) -> tuple[F64, F64, F64, F64, npt.NDArray[np.bool_]]:
    """Each row of ``value`` one group's members: ratio to and z against the peers' median, that median, the
    group's CV (one per row) and the hits (see :func:`argus.detectors.l2_phases.detect_l2`)."""
    peers, _, mad = row_spreads(value)
    scale = np.maximum(mad * MAD_SCALE, p.mad_floor * peers)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (value - peers) / scale
        ratio = np.maximum(value, _RESOLUTION_NS) / np.maximum(peers, _RESOLUTION_NS)
        mean = value.mean(axis=1)
        cv = np.where(mean > 0, value.std(axis=1) / mean, 0.0)
    use_z = value.shape[1] >= 3
    if collective:  # only short members (late arrivals); long ones waited or arrived early
        hit = (ratio <= 1.0 / p.late_arrival_ratio) & ((z <= -p.min_z) if use_z else True)
    else:
        hit = (ratio >= p.min_elevation) & ((z >= p.min_z) if use_z else True)
    return ratio, z, peers, cv, hit


def phase_flags(name: str, kind: PhaseKind, label: str, column: I64, has: npt.NDArray[np.bool_], per_step: F64,
                occ: F64, longest: F64, in_blocking: F64, rank: I64, p: L2Params,
                raw: Callable[[I64], F64] | None = None, ratios: F64 | None = None) -> list[Flag]:
    """The flags of one phase: its ranks (``has``) compared within their groups (``column``: each rank's
    group); ``per_step``, ``occ``, ``longest``, ``in_blocking`` and ``raw(positions)`` (the duration, waiting
    included, at those positions: read only for the groups where a compute phase flags a member; ``None``:
    ``per_step``) per rank (see ``detect_l2``), ``rank``
    the topology's ranks. In the order of a loop over the groups (ascending) and their members (by position).
    ``ratios`` (per rank, as ``per_step``): where given, each compared rank's ratio to its peers' median is
    written into it, flagged or not."""
    collective = kind.is_collective
    pos = np.flatnonzero(has)
    group = column[pos]
    order = np.lexsort((pos, group))
    pos, group = pos[order], group[order]
    uniq, first, size = np.unique(group, return_index=True, return_counts=True)
    found: list[tuple[int, int, Flag]] = []
    for n in np.unique(size).tolist():
        if n < 2:
            continue
        rows = np.flatnonzero(size == n)
        members = pos[first[rows][:, None] + np.arange(n)]
        value, rate = per_step[members], occ[members]
        top = rate.max(axis=1, keepdims=True)
        per_occurrence = (top - rate.min(axis=1, keepdims=True)) > 0.01 * top
        with np.errstate(invalid="ignore", divide="ignore"):
            value = np.where(per_occurrence, value / rate, value)
        ratio, z, peers, cv, hit = compare_rows(value, p, collective)
        if collective and n == 2:
            pair_z, stands_out = pair_outliers(value, p)
            z = -np.repeat(pair_z[:, None], 2, axis=1)  # a late member's z is negative, as in larger groups
            hit &= stands_out[:, None]
        if ratios is not None:
            ratios[members] = ratio
        if not collective and raw is not None and hit.any():
            # Only the groups with a flagged member: the durations are medians taken on demand.
            at = np.flatnonzero(hit.any(axis=1))
            with np.errstate(invalid="ignore", divide="ignore"):
                durations = raw(members[at])
                wall = np.where(per_occurrence[at], durations / rate[at], durations)
            hit[at] &= (wall - loo_median_rows(wall)) >= p.wall_share * (value[at] - peers[at])
        # What a flag tells beyond its ratio, for the groups with a flagged member only (row by row as for all).
        at = np.flatnonzero(hit.any(axis=1))
        if not at.size:
            continue
        mem = members[at]
        late_ns = (peers[at] - value[at]) * np.where(per_occurrence[at], rate[at], 1.0)
        late = late_ns / np.maximum(longest[mem], 1.0)
        blocked = in_blocking[mem]
        waited = (blocked - loo_median_rows(blocked)) / np.maximum(late_ns, 1.0)
        for h, i in zip(*np.nonzero(hit[at]), strict=True):
            g = at[h]
            zi = float(z[g, i]) if (n >= 3 or collective) and math.isfinite(float(z[g, i])) else None
            excess = float(late_ns[h, i]) if collective else float(-late_ns[h, i])
            found.append((int(rows[g]), int(i), Flag(
                int(rank[mem[h, i]]), name, kind, float(ratio[g, i]), zi, float(value[g, i]), float(peers[g, i]),
                float(cv[g]), f"{label}{int(uniq[rows[g]])}", float(late[h, i]), float(waited[h, i]), excess)))
    found.sort(key=lambda t: (t[0], t[1]))
    return [f for _, _, f in found]
