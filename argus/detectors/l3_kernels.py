"""L3 diagnosis: which ranks run one (kernel, stream) slower than the rest, from the compressed windows.

Input: every :class:`~argus.schemas.records.KernelSummary` of one (job, kernel, stream), each holding cluster
rows of some ranks and windows. All windows of a rank are merged into one log-normal mixture (weights =
cluster counts; see :mod:`argus.detectors.mixture`). Per comparison set of ranks
(a pipeline stage for compute, the job for collectives) each rank's W1 distance to the pointwise-median
reference is its score; :func:`detect_l3` flags outliers (:class:`L3Params`). The steps and the reading of
collectives with the topology: docs/internals/detectors.md.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.cdf_grid import median_sample, sample_reference, score_against
from argus.detectors.collective_groups import collective_groups, collective_kinds, is_p2p
from argus.detectors.experts import is_grouped_gemm
from argus.detectors.kernel_modes import ReferenceModes, reference_modes
from argus.detectors.kernel_rows import (
    SummaryColumns,
    calls_below,
    lower_part_floors,
    merge_rows,
    one_key,
    row_floors,
    window_end,
)
from argus.detectors.l2_groups import MAD_SCALE, loo_median
from argus.detectors.l2_phases import rank_positions
from argus.detectors.link_stats import faster_half
from argus.detectors.link_stats import late_candidates as _late_candidates
from argus.detectors.links import (
    CORROBORATES_ONLY,
    PIPELINE_SIDE,
    GroupKind,
    LinkParams,
    PseudoGroup,
    detect_links,
)
from argus.detectors.mixture import MixtureBatch, geometric_grid, log_normal_components, trapezoid_weights
from argus.schemas.records import JobTopology, KernelSummary, Level, ParallelGroup

__all__ = ["CORROBORATES_ONLY", "PIPELINE_SIDE", "L3Params", "L3Result", "RankScores", "Scope",
           "cluster_median_quantile", "detect_l3", "is_collective", "primary_p50", "score_ranks"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class Scope(enum.Enum):
    """Which ranks compute kernels are compared among."""

    JOB = "JOB"
    STAGE = "STAGE"


@dataclass(frozen=True)
class L3Params:
    """Thresholds of :func:`detect_l3` (defaults in brackets).

    ``iqr_k``: IQR fence multiplier [1.5]. ``min_score``: least W1 / reference mean of a flagged compute
    kernel [0.25]. ``collective_min_score``: the same for collectives, above healthy waiting spread [3.0].
    ``p50_ratio``: primary p50 over the lower-half median that flags a rank [3.0].
    ``collective_p50_ratio``: the same for collectives, above healthy waiting spread [4.0].
    ``short_ratio``: group peers' median typical call over a member's that names it a late arrival [5.0].
    ``min_events``: ranks with fewer events of the kernel are left out [10]; for a collective whose group
    is known (``group_kind``, or the topology has groups of one kind only to run it in: DP or TP)
    ``collective_min_events`` [5] (its groups are judged together: a DP all-reduce runs once a step, and a
    window of a few steps still holds it on every member). ``min_ranks``: fewest ranks
    to compare [2]. ``grid_points``: points of the shared CDF grid [512]. ``mode_log_gap``: gap in
    ``ln(ns)`` between component p50s that separates modes in :func:`primary_p50` [0.3].
    ``compute_scope``: compare compute kernels per pipeline stage or across the job [STAGE].
    ``collective_markers``: lower-case substrings marking a collective kernel [("nccl",)].
    ``mode_ratio``: a compute kernel's mode on a rank over the reference's that flags the rank, when it is
    also ``mode_z`` robust z-scores (log scale, MAD floored at ``mode_mad_floor``) above the other ranks
    [1.15, 5.0, 0.02]. ``links``: the thresholds of degraded links (:class:`~argus.detectors.links.LinkParams`).

    Raises :class:`DetectorError` for out-of-range values.
    """

    iqr_k: float = 1.5
    min_score: float = 0.25
    collective_min_score: float = 3.0
    p50_ratio: float = 3.0
    collective_p50_ratio: float = 4.0
    short_ratio: float = 5.0
    min_events: int = 10
    collective_min_events: int = 5
    min_ranks: int = 2
    grid_points: int = 512
    mode_log_gap: float = 0.3
    compute_scope: Scope = Scope.STAGE
    collective_markers: tuple[str, ...] = ("nccl",)
    mode_ratio: float = 1.15
    mode_z: float = 5.0
    mode_mad_floor: float = 0.02
    links: LinkParams = field(default_factory=LinkParams)
    #: Step (share of a rank's calls) of the u grid from 0.1 to 0.9 on which compute kernels' quantile functions
    #: are compared for an unseparated mode [0.05].
    scan_step: float = 0.05
    #: Calls a cluster needs for its p99 to describe a tail rather than its slowest call or two [100].
    tail_calls: int = 100
    #: Two or three ranks have no spread to judge by: a mode must be this much slower than the others' [1.3].
    small_set_ratio: float = 1.3
    #: Fewest ranks of a comparison set with a spread to judge by (robust z over the set); stages with fewer
    #: compare kernels that every rank runs alike job-wide [4].
    spread_set: int = 4
    #: Ranks whose calls of a kernel differ from the set's median by more than this share are not judged by
    #: mode [0.02].
    same_calls: float = 0.02
    #: How far up each mode of a collective its members' fast calls are read (their transfers, with less
    #: waiting), as a share of the mode's width [0.25].
    low_part: float = 0.25
    #: A compute kernel's slow mode, or its modelled mean shift, must show in the rank's total time: at least
    #: this share of the excess its calls at that mode's ratio (or shift) would add (a few stray calls stretch a
    #: cluster's modelled tail over many levels, or move a small cluster's p50, not the total) [0.5].
    mode_excess_share: float = 0.5

    @property
    def scan_levels(self) -> F64:
        """The u grid of ``scan_step`` (0.1 to 0.9, both included)."""
        return np.arange(0.1, 0.9 + 1e-9, self.scan_step)

    def __post_init__(self) -> None:
        for name in ("iqr_k", "min_score", "collective_min_score"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise DetectorError(f"{name} must be finite and >= 0, got {value}")
        for name in ("p50_ratio", "collective_p50_ratio", "short_ratio", "mode_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 1.0):
                raise DetectorError(f"{name} must be finite and > 1, got {value}")
        if self.min_events < 1 or self.collective_min_events < 1 or self.min_ranks < 2 or self.grid_points < 16:
            raise DetectorError("need min_events >= 1, min_ranks >= 2 and grid_points >= 16")
        if not (math.isfinite(self.mode_log_gap) and self.mode_log_gap > 0.0) or not self.collective_markers:
            raise DetectorError("mode_log_gap must be finite and > 0, collective_markers non-empty")
        if not (self.mode_z >= 0.0 and 0.0 < self.mode_mad_floor < 1.0):
            raise DetectorError("mode_z must be >= 0, mode_mad_floor in (0, 1)")
        if not (0.0 < self.scan_step <= 0.4 and 0.0 < self.low_part < 1.0 and 0.0 <= self.same_calls < 1.0):
            raise DetectorError(f"need scan_step in (0, 0.4], low_part in (0, 1) and same_calls in [0, 1), got "
                                f"{self.scan_step}, {self.low_part}, {self.same_calls}")
        if not 0.0 <= self.mode_excess_share <= 1.0:
            raise DetectorError(f"mode_excess_share must be in [0, 1], got {self.mode_excess_share}")
        if not (math.isfinite(self.small_set_ratio) and self.small_set_ratio > 1.0):
            raise DetectorError(f"small_set_ratio must be finite and > 1, got {self.small_set_ratio}")
        if self.tail_calls < 2 or self.spread_set < 2:
            raise DetectorError(f"need tail_calls >= 2 and spread_set >= 2, got {self.tail_calls}, {self.spread_set}")


@dataclass(frozen=True)
class L3Result:
    """One L3 finding about ``kernel`` on ``stream``: the ``ranks`` implicated, a unitless ``score`` and
    ``evidence`` (units in the keys). Score: the top rank's W1 / reference mean (KERNEL_DEGRADED), the
    group's median p50 over the healthy majority's (LINK_DEGRADED), peers' p50 over the rank's (late)."""

    kind: FindingKind
    ranks: tuple[int, ...]
    kernel: str
    stream: int
    score: float
    evidence: dict[str, Any] = field(default_factory=dict)
    #: Always empty: L3 findings are about ranks, not steps.
    steps: tuple[int, ...] = ()
    #: Extra time (ns) on the job's critical path over the judged data: the slowest named rank's time in the
    #: kernel beyond its peers' median (a degraded link: its group's extra transfer time per member).
    excess_ns: float = 0.0
    #: Share of the judged steps the excess was spent in, where the named rank's calls show a slowdown that
    #: began inside them (:func:`~argus.detectors.call_modes.affected_share`); 1.0: every step.
    affected_share: float = 1.0

    @property
    def level(self) -> Level:
        return self.kind.level


@dataclass(frozen=True, eq=False)
class RankScores:
    """Per-rank results of :func:`score_ranks` (arrays in the order of the input mixtures).

    ``w1_ns``: W1 to the median CDF; ``shift_ns``: signed mean difference to it (> 0: slower);
    ``score``: ``w1_ns / reference_mean_ns``; ``primary_p50_ns``: see :func:`primary_p50`.
    ``grid`` (ns), ``weights`` (its trapezoid weights) and ``reference`` (the median CDF on ``grid``);
    ``levels``: the cumulative fractions at which each rank's quantiles were read, ``quantiles_ns`` those
    quantiles (``R x len(levels)``, see :func:`~argus.detectors.kernel_modes.mode_quantiles`).
    """

    w1_ns: F64
    shift_ns: F64
    score: F64
    primary_p50_ns: F64
    reference_mean_ns: float
    grid: F64
    weights: F64
    reference: F64
    levels: F64
    quantiles_ns: F64


#: Given the reference CDF and the grid (ns), the levels at which :func:`score_ranks` reads each rank's quantiles.
Levels = Callable[[F64, F64], F64]


def is_collective(kernel: str, markers: Sequence[str] = ("nccl",)) -> bool:
    """Whether ``kernel`` is a collective (its lower-cased name contains one of ``markers``)."""
    return any(m in kernel.lower() for m in markers)


def score_ranks(mixtures: MixtureBatch, grid_points: int = 512, mode_log_gap: float = 0.3,
                levels: Levels | None = None) -> RankScores:
    """W1 of each of ``R`` mixtures to their pointwise-median CDF, in O(R * K * G) (module docstring), and
    each mixture's quantiles at ``levels(reference, grid)`` (none by default). The median is over all
    mixtures, or over a fixed sample of :data:`~argus.detectors.cdf_grid.MEDIAN_SAMPLE` of more."""
    grid = geometric_grid(mixtures, points=grid_points)
    log_grid = np.log(grid)
    mu, sigma, weight = log_normal_components(mixtures.counts, mixtures.p50_ns, mixtures.p99_ns)
    ref = sample_reference(mu, sigma, weight, log_grid, median_sample(len(mixtures)))
    w = trapezoid_weights(grid)
    lv = np.empty(0) if levels is None else np.asarray(levels(ref, grid), dtype=np.float64)
    w1, shift, quantiles = score_against(mu, sigma, weight, log_grid, ref, w, lv)
    ref_mean = float(grid[0] + (1.0 - ref) @ w)
    return RankScores(w1, shift, w1 / ref_mean, primary_p50(mixtures, mode_log_gap), ref_mean, grid, w, ref,
                      lv, quantiles)


def primary_p50(mixtures: MixtureBatch, mode_log_gap: float = 0.3) -> F64:
    """Per mixture, the p50 (ns) of its primary mode: the mode with the most events.

    A rank's components come from several windows, so one duration mode appears once per window. The
    components are sorted by p50 and cut into modes wherever neighbouring p50s are more than
    ``mode_log_gap`` apart in ``ln(ns)`` (0.3: ~35 %); the mode with the largest summed count wins and
    its p50 is the count-weighted median of its components' p50s.
    """
    counts, logp = mixtures.counts, np.log(mixtures.p50_ns)
    logp = np.where(counts > 0, logp, np.inf)  # padding sorts last, in runs of zero count
    order = np.argsort(logp, axis=1, kind="stable")
    sp, sc = np.take_along_axis(logp, order, axis=1), np.take_along_axis(counts, order, axis=1)
    rows, k = sc.shape
    with np.errstate(invalid="ignore"):
        cut = np.diff(sp, axis=1) > mode_log_gap
    run = np.concatenate([np.zeros((rows, 1), dtype=np.int64), np.cumsum(cut, axis=1)], axis=1)
    flat = (np.arange(rows)[:, None] * k + run).ravel()
    run_count = np.bincount(flat, weights=sc.ravel(), minlength=rows * k).reshape(rows, k)
    best = np.argmax(run_count, axis=1)
    in_best = np.where(run == best[:, None], sc, 0.0)
    cum = np.cumsum(in_best, axis=1)
    pick = np.argmax(cum >= 0.5 * cum[:, -1:], axis=1)
    out: F64 = np.exp(np.take_along_axis(sp, pick[:, None], axis=1)[:, 0])
    return out


def detect_l3(summaries: Sequence[KernelSummary], topology: JobTopology | None = None,
              params: L3Params | None = None, group_kind: ParallelGroup | None = None) -> list[L3Result]:
    """Slow ranks of one (job, kernel, stream) from its summaries (see the module docstring).

    ``summaries``: all KernelSummary records of one (job, kernel, stream), any windows; a rank's rows
    are merged. ``topology``: the job's groups; without it compute kernels are compared across the job
    and collectives cannot be attributed to links or late arrivals (slow ranks become KERNEL_DEGRADED,
    late arrivals are judged against all ranks). ``params`` defaults to ``L3Params()``. ``group_kind``: the
    parallel group a collective kernel runs in, when known (e.g. from the job's phases on that stream);
    only groups of that kind then explain it.

    Raises :class:`DetectorError` for summaries of different (job, kernel, stream), inconsistent rows, or
    ranks missing from ``topology``.
    """
    p = params if params is not None else L3Params()
    if not summaries:
        return []
    first = summaries[0]
    if not one_key(summaries):
        raise DetectorError("detect_l3 needs the summaries of exactly one (job, kernel, stream)")
    collective = is_collective(first.kernel, p.collective_markers)
    if not collective and topology is not None and topology.ep_size >= 2 and is_grouped_gemm(first.kernel):
        # An expert-parallel job's grouped GEMMs run each rank's routed tokens, not the same work: they are
        # judged per token or per EP group, over the job (kernel_excess; argus.detectors.experts).
        return []
    # Few calls of a collective are judged only in one grouping (the group the trace named, or the only kind
    # the topology has): read in every grouping, a handful of calls per member is too little to tell waiting
    # from a slow group.
    named = group_kind is not None and group_kind is not ParallelGroup.NONE
    one_grouping = named or (collective and topology is not None and not is_p2p(first.kernel)
                             and collective_kinds(topology) == 1)
    cols = SummaryColumns(summaries)  # each column read once, for every check below
    ranks, batch, total = merge_rows(cols, p.collective_min_events if collective and one_grouping
                                     else p.min_events)
    if batch is None or ranks.size < p.min_ranks:
        return []
    if topology is not None:
        rank_positions(topology, ranks)  # raises for ranks not in it
    # ``group_known``: the collective's group is known (its phases or the topology named it), or each
    # grouping is tried.
    base: dict[str, Any] = {"window_end_ns": window_end(cols), "n_ranks": int(ranks.size),
                            "collective": collective}
    if collective:
        base["group_known"] = named
        return _collective(cols, ranks, batch, total, topology, p, base, group_kind)
    return _compute(cols, ranks, batch, total, topology, p, base)


def _slow_ranks(sc: RankScores, min_score: float, gate: float, p: L3Params) -> tuple[npt.NDArray[np.bool_], F64,
                                                                                     float]:
    """Slow mask (IQR-with-gate or p50 path), each rank's p50 over the healthy majority, that baseline."""
    n = sc.score.size
    slow = np.zeros(n, dtype=bool)
    if n >= 4:
        q1, q3 = np.percentile(sc.score, [25.0, 75.0])
        slow |= (sc.score > q3 + p.iqr_k * (q3 - q1)) & (sc.score >= min_score) & (sc.shift_ns > 0.0)
    healthy = float(faster_half(sc.primary_p50_ns[:, None])[0])
    p50_ratio = sc.primary_p50_ns / healthy
    slow |= p50_ratio >= gate
    return slow, p50_ratio, healthy


def _trusted_levels(batch: MixtureBatch, p: L3Params) -> npt.NDArray[np.bool_]:
    """Per rank and level of ``p.scan_levels``: whether the level lies among the calls of a cluster with the
    calls for a modelled tail (``p.tail_calls``; clusters ordered by p50, each holding its share of the rank's
    calls). In a smaller cluster the p99 is its slowest call or two: one stray call would stretch its
    modelled tail, and the levels read there."""
    order = np.argsort(np.where(batch.counts > 0, batch.p50_ns, np.inf), axis=1, kind="stable")
    counts = np.take_along_axis(batch.counts, order, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.cumsum(counts, axis=1) / counts.sum(axis=1, keepdims=True)
    # Per level, the clusters wholly below it: a pass per cluster (a rank has a few; a sum over a last axis of
    # that length costs several times more).
    levels = p.scan_levels
    below = np.zeros((share.shape[0], levels.size), dtype=np.int64)
    for k in range(share.shape[1]):
        below += share[:, k, None] <= levels[None, :]
    at = np.minimum(below, counts.shape[1] - 1)
    out: npt.NDArray[np.bool_] = np.take_along_axis(counts >= p.tail_calls, at, axis=1)
    return out


def _mode_outliers(sc: RankScores, p: L3Params, trusted: npt.NDArray[np.bool_], modes: ReferenceModes,
                   mode_q: F64, scan_q: F64, floors: F64 | None = None
                   ) -> tuple[npt.NDArray[np.bool_], F64, F64, F64]:
    """Ranks with a mode slower than the reference's (see :mod:`argus.detectors.kernel_modes`): the mask, each
    rank's largest mode ratio, the share of calls of that mode, and the other ranks' time there (ns).
    ``trusted``: per rank and level of the fixed u grid, whether the level is read in a modelled tail that holds
    (:func:`_trusted_levels`; the upper levels of a cluster lie in its tail). ``modes``: the reference's;
    ``mode_q`` and ``scan_q``: each rank's quantiles (ns) at the modes' middles and at ``p.scan_levels``.
    ``floors``: at the same levels, modes' then scan's, each rank's shortest call of the cluster in whose lower
    part the level lies, NaN elsewhere (:func:`~argus.detectors.kernel_rows.lower_part_floors`): a level there
    is slow only where that call is slower than the other ranks' quantile too."""
    n = sc.score.size
    logq = np.log(mode_q)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_floor = np.log(floors) if floors is not None else np.full((n, mode_q.shape[1] + scan_q.shape[1]), np.nan)
    if n >= 4:
        centre = np.median(logq, axis=0)
        lr = logq - centre
        ref_q = np.broadcast_to(centre, logq.shape)
        mad = MAD_SCALE * np.median(np.abs(lr), axis=0)
        hit = (lr >= math.log(p.mode_ratio)) & (lr >= p.mode_z * np.maximum(mad, p.mode_mad_floor))
        hit &= ~(log_floor[:, :lr.shape[1]] <= centre)
    else:  # two or three ranks: against the others' median, and a wider gate
        others = np.stack([loo_median(col) for col in logq.T], axis=1)
        lr = logq - others
        ref_q = others
        hit = (lr >= math.log(max(p.mode_ratio, p.small_set_ratio))) & ~(log_floor[:, :lr.shape[1]] <= others)
    best = np.argmax(np.where(hit, lr, -np.inf), axis=1)
    rows = np.arange(n)
    found, ratio, share = hit.any(axis=1), np.exp(lr[rows, best]), modes.width[best]
    at = np.exp(ref_q[rows, best])
    if n >= 4:
        # Shapes of one kernel a few percent apart make no plateau between them: one mode. A slower shape
        # then still lifts the quantile function over the u range of its calls, so the rank's quantiles are
        # read on a fixed u grid too; a run of two neighbouring levels is needed (a lone level is noise).
        lq = np.log(scan_q)
        middle = np.median(lq, axis=0)
        lq -= middle
        floor = np.maximum(MAD_SCALE * np.median(np.abs(lq), axis=0), p.mode_mad_floor)
        level = ((lq >= math.log(p.mode_ratio)) & (lq >= p.mode_z * floor) & trusted
                 & ~(log_floor[:, logq.shape[1]:] <= middle))
        run = level[:, 1:] & level[:, :-1]
        scan = run.any(axis=1) & ~found
        if scan.any():
            top = np.argmax(np.where(level, lq, -np.inf), axis=1)
            ratio = np.where(scan, np.exp(lq[rows, top]), ratio)
            share = np.where(scan, float(run.sum(axis=1).max() + 1) * p.scan_step, share)
            at = np.where(scan, np.exp(middle[top]), at)
            found = found | scan
    return found, ratio, share, at


def _compute(cols: SummaryColumns, ranks: I64, batch: MixtureBatch, total: F64,
             topology: JobTopology | None, p: L3Params, base: dict[str, Any]) -> list[L3Result]:
    s = cols.summaries[0]
    stages: I64 | None = None  # the ranks' stages when compared job-wide
    if topology is not None and p.compute_scope is Scope.STAGE:
        part = topology.array("pp_stage")[rank_positions(topology, ranks)]
        calls = batch.counts.sum(axis=1)
        if (np.unique(part, return_counts=True)[1].min() < p.spread_set and ranks.size >= p.spread_set
                and bool(np.all(np.abs(calls / np.median(calls) - 1.0) <= p.same_calls))):
            # Stages of a few ranks have no spread to judge by; a kernel every rank of the job runs equally
            # often runs the same shapes in every stage (the transformer layers): compare it job-wide. A
            # stage slow as a whole is left to the stage detectors (below).
            stages, part = part, np.zeros(ranks.size, dtype=np.int64)
    else:
        part = np.zeros(ranks.size, dtype=np.int64)
    flagged: dict[int, dict[str, Any]] = {}
    for g in np.unique(part).tolist():
        rows = np.flatnonzero(part == g)
        if rows.size < p.min_ranks:
            continue
        sub = MixtureBatch(batch.counts[rows], batch.p50_ns[rows], batch.p99_ns[rows])
        # Every level read at once (one search per rank): the modes' middles, the scan grid, the 90th.
        sc = score_ranks(sub, p.grid_points, p.mode_log_gap, functools.partial(_compute_levels, scan=p.scan_levels))
        slow, p50_ratio, healthy = _slow_ranks(sc, p.min_score, p.p50_ratio, p)
        tails = ((sub.counts == 0.0) | (sub.counts >= p.tail_calls)).all(axis=1)
        modes = reference_modes(sc.reference, sc.grid)
        q = sc.quantiles_ns
        floors = lower_part_floors(cols, ranks[rows], np.concatenate([modes.mid, p.scan_levels]))
        by_mode, mode_ratio, mode_share, mode_at = _mode_outliers(sc, p, _trusted_levels(sub, p), modes,
                                                                  q[:, :len(modes)], q[:, len(modes):-1], floors)
        # Modes are matched by position among a rank's calls: only ranks with the set's calls (a window cut
        # between the ranks' calls of one step shifts every position) are judged by mode.
        calls = batch.counts[rows].sum(axis=1)
        by_mode &= np.abs(calls / np.median(calls) - 1.0) <= p.same_calls
        excess = total[rows] - np.median(total[rows])
        by_mode &= excess >= p.mode_excess_share * mode_share * calls * mode_at * (mode_ratio - 1.0)
        # A distance grown by a few stray calls (under a tenth of them) is no slow kernel: the W1 and p50
        # paths need the rank's 90th percentile raised too. The modelled tail holds only where every
        # cluster has the calls for a p99; in a smaller one the p99 is its slowest call or two, and one
        # stray call would stretch the whole modelled tail, so there the clusters' medians are read.
        q90 = np.where(tails, q[:, -1], cluster_median_quantile(sub, 0.9))
        slow &= q90 >= p.mode_ratio * np.median(q90)
        # Likewise the modelled shift must show in the total: in a cluster of a few calls holding two shapes, one
        # stray call moves the p50 from between them onto the upper one, a shift of the whole cluster that the
        # total (one call's excess) does not bear out.
        slow &= excess >= p.mode_excess_share * calls * sc.shift_ns
        for i in np.flatnonzero((slow | by_mode) & (excess > 0.0)).tolist():
            flagged[int(ranks[rows[i]])] = {
                "score": float(max(sc.score[i], mode_ratio[i] - 1.0 if by_mode[i] else 0.0)),
                "w1_ns": float(sc.w1_ns[i]), "mean_shift_ns": float(sc.shift_ns[i]),
                "p50_ratio": float(p50_ratio[i]), "primary_p50_ns": float(sc.primary_p50_ns[i]),
                "mode_ratio": float(mode_ratio[i]) if by_mode[i] else None,
                "mode_share_of_calls": float(mode_share[i]) if by_mode[i] else None,
                "healthy_p50_ns": healthy, "reference_mean_ns": sc.reference_mean_ns, "partition": int(g),
                "excess_ns": float(excess[i]),
            }
    if stages is not None:
        stage_all = {st: set(ranks[stages == st].tolist()) for st in np.unique(stages).tolist()}
        flagged = {r: v for r, v in flagged.items() if not stage_all[int(stages[ranks == r][0])] <= flagged.keys()}
    # One finding per rank: each is judged on its own impact (a rank riding along a strong one is not).
    scope = p.compute_scope.value if topology is not None else Scope.JOB.value
    return [L3Result(FindingKind.KERNEL_DEGRADED, (r,), s.kernel, s.stream, v["score"],
                     base | {f"top_{k}": x for k, x in v.items() if k != "score"} | {
                         "scope": scope, "top_rank": r, "flagged_ranks": sorted(flagged),
                         "rank_score": {str(r): v["score"]}, "rank_p50_ratio": {str(r): v["p50_ratio"]},
                         "rank_excess_ns": {str(r): v["excess_ns"]}},
                     excess_ns=v["excess_ns"]) for r, v in sorted(flagged.items())]


def _compute_levels(reference: F64, grid: F64, scan: F64) -> F64:
    """A compute kernel's quantile levels: its reference modes' middles, the ``scan`` grid and the 90th."""
    return np.concatenate([reference_modes(reference, grid).mid, scan, [0.9]])


def _collective_levels(reference: F64, grid: F64, low_part: float) -> F64:
    """A collective's quantile levels: its reference modes' middles, then their lower parts (``low_part``
    of the way up each mode)."""
    modes = reference_modes(reference, grid)
    return np.concatenate([modes.mid, modes.lo + low_part * modes.width])


def cluster_median_quantile(batch: MixtureBatch, q: float) -> F64:
    """Per row, the ``q`` quantile of the calls with each call at its cluster's median (ns): the level
    below which ``q`` of the calls' clusters sit, untouched by the spread inside any cluster."""
    order = np.argsort(batch.p50_ns, axis=1)
    counts = np.take_along_axis(batch.counts, order, axis=1)
    p50 = np.take_along_axis(batch.p50_ns, order, axis=1)
    cum = np.cumsum(counts, axis=1)
    at = np.argmax(cum >= q * cum[:, -1:], axis=1)
    out: F64 = p50[np.arange(p50.shape[0]), at]
    return out


def _collective(cols: SummaryColumns, ranks: I64, batch: MixtureBatch, total: F64,
                topology: JobTopology | None, p: L3Params, base: dict[str, Any],
                group_kind: ParallelGroup | None = None) -> list[L3Result]:
    s = cols.summaries[0]
    sc = score_ranks(batch, p.grid_points, p.mode_log_gap, functools.partial(_collective_levels, low_part=p.low_part))
    slow, p50_ratio, healthy = _slow_ranks(sc, p.collective_min_score, p.collective_p50_ratio, p)
    # A late arrival is judged by each member's typical call (the median call, at its cluster's median): a
    # waiting member's calls spread over several modes, the most populous of which may be its few fast ones.
    p50 = cluster_median_quantile(batch, 0.5)
    p2p = is_p2p(s.kernel) or group_kind is ParallelGroup.PP
    groups = collective_groups(topology, ranks, p2p, group_kind)
    every_group = groups if group_kind is None else collective_groups(topology, ranks, p2p)
    explained = np.zeros(ranks.size, dtype=bool)
    results: list[L3Result] = []
    if topology is not None:
        stage_of = dict(zip(topology.rank, topology.pp_stage, strict=True))
        stage = np.array([stage_of[r] for r in ranks.tolist()], dtype=np.int64)
        floors = functools.cache(lambda within: row_floors(cols, ranks, within=within))
        results = [L3Result(FindingKind.LINK_DEGRADED, link.ranks, s.kernel, s.stream, link.evidence.transfer_ratio,
                            link.evidence.as_dict(), excess_ns=link.excess_ns)
                   for link in detect_links(ranks, batch, sc, groups, stage, p50, floors, explained,
                                            base["window_end_ns"], bool(base["group_known"]), p.links,
                                            lambda rows, limits: calls_below(cols, ranks[rows], limits))]
    late: list[tuple[float, GroupKind, int, int, I64, float]] = []
    whole = [grp for grp in groups if grp[0] is not PseudoGroup.PP_SIDE]  # a rank alone has no peers to be late for
    for size in sorted({rows.size for _, _, rows in whole}, reverse=True):  # larger groups explain first
        same = [grp for grp in whole if grp[2].size == size]
        for ratio, kind, g, row, rows, peers_p50 in _late_candidates(same, p50, p.links.late_arrival_ratio):
            if not (explained[row] or explained[rows[rows != row]].all()):
                explained[rows] = True
                late.append((ratio, kind, g, row, rows, peers_p50))
    # Late arrivals that together make up a whole group of another kind (both ranks of a TP group) arrived
    # late together: which of them held the others up shows only in that group's own collective.
    together = np.zeros(ranks.size, dtype=bool)
    together[[entry[3] for entry in late]] = True
    calls = batch.counts.sum(axis=1)
    member_rows = np.concatenate([r for _, _, r in every_group]) if every_group else np.empty(0, dtype=np.int64)
    member_group = np.repeat(np.arange(len(every_group)), [r.size for _, _, r in every_group])
    for ratio, kind, g, row, rows, peers_p50 in late:
        if ratio < p.short_ratio or any(together[every_group[i][2]].all() for i in member_group[member_rows == row]
                                        if not np.array_equal(every_group[i][2], rows)):
            continue  # explains its peers' waiting, too weak to name or late with its whole group
        others = rows[rows != row]
        results.append(L3Result(FindingKind.LATE_ARRIVAL, (int(ranks[row]),), s.kernel, s.stream,
                                ratio, {
            **base, "group": f"{kind.value}{g}", "group_kind": kind.value, "group_index": g,
            "collective_short": True,
            "peers_over_rank_p50_ratio": ratio, "rank_p50_ns": float(p50[row]), "peers_p50_ns": peers_p50,
            "waiting_peers": [int(r) for r in ranks[others]],
        }, excess_ns=float((peers_p50 - p50[row]) * calls[row])))
    rest = np.flatnonzero(slow & ~explained)
    # A collective ends together on every member, so one member's longer collective only means it arrived
    # earlier and waited: with the topology known that is never the member's own fault (a slow link slows
    # the whole group, a late peer is found above), so unexplained slow members are not named.
    if rest.size and topology is None:
        top = int(rest[np.argmax(sc.score[rest])])
        results.append(L3Result(FindingKind.KERNEL_DEGRADED, tuple(int(r) for r in ranks[rest]), s.kernel, s.stream,
                                float(sc.score[top]), {
            **base, "whole_group": False, "healthy_p50_ns": healthy,
            "rank_score": {str(int(ranks[i])): float(sc.score[i]) for i in rest.tolist()},
            "rank_p50_ratio": {str(int(ranks[i])): float(p50_ratio[i]) for i in rest.tolist()},
        }, excess_ns=float(np.max(total[rest]) - np.median(total))))
    return results
