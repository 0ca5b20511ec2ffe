"""Statistics of parallel groups' collective times that the link rule reads (pure numerics).

A collective ends together on every member of its group, so the fastest member's time is the transfer and
the others' hold waiting: :func:`group_minima` reads each group's fastest member, :func:`faster_half` the
healthy groups' level, :func:`late_candidates` the members that posted last, :func:`floor_log_ratios` and
friends the fastest calls of pipeline sides, :func:`inter_intra` how far a group's durations lie from the
others'. Times in ns, ratios of times unitless, logs natural.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from argus.detectors.cdf_grid import median_sample, pointwise_median
from argus.detectors.l2_groups import MAD_SCALE, loo_median_rows
from argus.detectors.mixture import MixtureBatch, mixture_cdf

if TYPE_CHECKING:
    from argus.detectors.l3_kernels import RankScores

__all__ = ["FloorGates", "faster_half", "floor_log_ratios", "floor_outliers", "group_minima", "inter_intra",
           "late_candidates", "raised_floors"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
K = TypeVar("K")


class FloorGates(Protocol):
    """The gates :func:`floor_outliers` reads (:class:`~argus.detectors.links.LinkParams` has them)."""

    @property
    def ratio(self) -> float: ...
    @property
    def z(self) -> float: ...
    @property
    def mad_floor(self) -> float: ...
    @property
    def max_ratio(self) -> float: ...
    @property
    def spread_set(self) -> int: ...


def late_candidates(groups: Sequence[tuple[K, int, I64]], p50: F64, late_ratio: float
                    ) -> list[tuple[float, K, int, int, I64, float]]:
    """(ratio, kind, index, row, rows, peers' p50) of members ``late_ratio`` x shorter than their group peers
    (late arrivals), strongest first; a group with over a quarter of short members has none (only the last
    arrival of a call is short). ``groups``: all of one size (judged at once, as a groups x members array)."""
    if not groups:
        return []
    members = np.stack([rows for _, _, rows in groups])
    v = p50[members]
    size = members.shape[1]
    calm = np.sum(late_ratio * v <= np.median(v, axis=1, keepdims=True), axis=1) <= max(1, size // 4)
    peers = loo_median_rows(v)
    ratio = peers / v
    out = [(float(ratio[i, j]), groups[i][0], groups[i][1], int(members[i, j]), groups[i][2], float(peers[i, j]))
           for i, j in zip(*np.nonzero(calm[:, None] & (ratio >= late_ratio)), strict=True)]
    out.sort(key=lambda c: (-c[0], c[3]))
    return out


def floor_log_ratios(floors: F64) -> F64 | None:
    """Per group, ``ln`` of its floor (its members' fastest calls, ns; NaN where unknown) over the faster half
    of the known ones (NaN where unknown); ``None`` when fewer than two are known (nothing to compare)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        fl = np.log(floors)
    known = np.isfinite(fl)
    if known.sum() < 2:
        return None
    out: F64 = np.where(known, fl - faster_half(fl[known][:, None])[0], np.nan)
    return out


def raised_floors(floors: F64, ratio: float) -> Bools | None:
    """Which of ``floors`` (see :func:`floor_log_ratios`) are at least ``ratio`` times the faster half of the
    known ones (an unknown one never is); ``None`` when fewer than two are known."""
    lr = floor_log_ratios(floors)
    if lr is None:
        return None
    with np.errstate(invalid="ignore"):
        out: Bools = lr >= math.log(ratio)
    return out


def floor_outliers(floors: F64, calls: float, p: FloorGates) -> tuple[Bools, F64, F64]:
    """Of pipeline sides (``floors``: each one's fastest calls, ns; NaN where unknown), which are slow by their
    floors alone: ``ratio`` over the faster half of the known ones and ``z`` robust z-scores above them
    (floored at ``mad_floor``), up to ``max_ratio``; with each one's log ratio and its excess over ``calls``
    calls (ns, every call's transfer that much slower; 0 where not slow)."""
    lr = floor_log_ratios(floors)
    known = np.isfinite(lr) if lr is not None else np.zeros(floors.size, dtype=bool)
    if lr is None or known.sum() < p.spread_set:
        return np.zeros(floors.size, dtype=bool), np.zeros(floors.size), np.zeros(floors.size)
    lr = np.where(known, lr, -np.inf)
    mad = MAD_SCALE * float(np.median(np.abs(lr[known] - np.median(lr[known]))))
    slow = (lr >= math.log(p.ratio)) & (lr >= p.z * max(mad, p.mad_floor)) & (lr <= math.log(p.max_ratio))
    extra = np.where(slow, floors * -np.expm1(-lr) * calls, 0.0)  # floor minus the reference floor, per call
    return slow, np.where(known, lr, 0.0), extra


def group_minima(q: F64, members: list[I64]) -> F64:
    """Per group (its rows of ``q``), the column-wise minimum: a ``groups x columns`` array. Groups of one
    size are read at once."""
    out = np.empty((len(members), q.shape[1]))
    by_size: dict[int, list[int]] = {}
    for i, rows in enumerate(members):
        by_size.setdefault(rows.size, []).append(i)
    for at in by_size.values():
        out[at] = q[np.stack([members[i] for i in at])].min(axis=1)
    return out


def faster_half(lg: F64) -> F64:
    """Per column, the median of the faster half of the rows (groups): the healthy groups' level."""
    out: F64 = np.median(np.sort(lg, axis=0)[: (lg.shape[0] + 1) // 2], axis=0)
    return out


def inter_intra(batch: MixtureBatch, sc: RankScores, group: I64, normal: I64, resolution: float) -> float | None:
    """W1 between the group's and the normal ranks' median CDFs over the mean W1 of ranks to their side's
    (each side's CDFs evaluated again on ``sc.grid``; of more than :data:`~argus.detectors.cdf_grid.
    MEDIAN_SAMPLE` normal ranks, a fixed sample's); the mean W1 floored at ``resolution`` x the reference's mean
    call."""
    if normal.size == 0:
        return None
    sides = []
    for rows in (group, normal[median_sample(normal.size)]):
        cdf = mixture_cdf(batch.counts[rows], batch.p50_ns[rows], batch.p99_ns[rows], sc.grid)
        sides.append((cdf, pointwise_median(cdf)))
    (cdf_g, med_g), (cdf_n, med_n) = sides
    inter = float(np.abs(med_g - med_n) @ sc.weights)
    intra = float(np.concatenate([np.abs(cdf_g - med_g) @ sc.weights, np.abs(cdf_n - med_n) @ sc.weights]).mean())
    # Identical ranks on each side give intra = 0; the floor is the grid's resolution of a W1 score.
    return inter / max(intra, resolution * sc.reference_mean_ns)
