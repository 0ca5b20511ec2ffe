"""L3 per rank: a rank slower than its peers across many kernels, each with too few calls to judge alone.

A real trace is often one or two steps long, so each kernel name runs 1-3 times per rank: no single-kernel
test has samples enough, yet a rank whose every GEMM runs 30 % slower is plain when the kernels are taken
together. :func:`detect_rank_excess` pools the evidence of every compute kernel of the job per rank:
see docs/internals/detectors.md.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from scipy.special import ndtri
from scipy.stats import rankdata

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.call_modes import CallCensus, ModeParams, affected_share, moved_calls
from argus.detectors.experts import is_grouped_gemm
from argus.detectors.l2_groups import MAD_SCALE, loo_median
from argus.detectors.l2_phases import L2Result
from argus.detectors.l3_kernels import L3Result, is_collective
from argus.schemas.records import JobTopology, KernelSummary

__all__ = ["KernelTotals", "MovedCalls", "RankExcessParams", "comparison_sets", "counted_peak", "detect_rank_excess",
           "detect_stage_excess", "kernel_family", "set_speeds", "totals_matrix", "trimmed_sum"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


#: Calls a cluster needs for its longest one to be counted as its second longest (:func:`trimmed_sum`): from two
#: up to 101 calls the summary's p99 (numpy's linear quantile) lies between the two longest, which gives the second.
_TRIM_CALLS = (2, 101)


def counted_peak(count: int, p99_ns: float, max_ns: float) -> float:
    """A cluster's longest call (ns) as :func:`trimmed_sum` counts it: its second longest for clusters of 2 to
    101 calls (read from the p99: ``p99 = x[n-2] + (1 - 0.01 (n - 1)) (x[n-1] - x[n-2])``), else ``max_ns``."""
    lo, hi = _TRIM_CALLS
    if not lo <= count <= hi or max_ns <= p99_ns:
        return float(max_ns)
    return max(max_ns - (max_ns - p99_ns) / (0.01 * (count - 1)), 0.0)


def trimmed_sum(count: int, sum_ns: float, p99_ns: float, max_ns: float) -> float:
    """A cluster's total time (ns) with its longest call counted as its second longest, for clusters of 2 to
    101 calls (others: ``sum_ns``; :func:`counted_peak`). One hiccup (a preemption, a retry) makes a call far
    longer than its cluster's others and moves a kernel's total on one rank by a few percent, which in a large
    job is many of the set's noise; a slow rank slows all of its calls, and loses only the gap between its two
    longest."""
    return float(sum_ns) - (float(max_ns) - counted_peak(count, p99_ns, max_ns))


@dataclass
class KernelTotals:
    """Per rank: total time (ns) and calls of one (kernel, stream) over a job, accumulated from summaries,
    each cluster's longest call counted as its second longest (:func:`trimmed_sum`).

    ``median_ns``: the time as the clusters' medians give it (``sum(count * p50)``), which a few outlier calls
    do not move; absent for a rank whose totals came from a context without it (schema v1). ``peak_ns``: the
    longest call as the totals count it (:func:`counted_peak`), which bounds what one call adds to them; absent
    for a rank whose totals came from a context without it (schema v4 and before). ``census``: each rank's
    calls per duration bin (:class:`~argus.detectors.call_modes.CallCensus`), None for totals read from a
    context, which carry ``moved`` instead: (calls moved, of) per rank (schema v6; :meth:`moved_calls`)."""

    kernel: str
    stream: int
    total_ns: dict[int, float] = field(default_factory=dict)
    calls: dict[int, float] = field(default_factory=dict)
    median_ns: dict[int, float] = field(default_factory=dict)
    peak_ns: dict[int, float] = field(default_factory=dict)
    moved: dict[int, tuple[float, float]] = field(default_factory=dict)
    census: CallCensus | None = field(default_factory=CallCensus, repr=False, compare=False)
    mode_params: ModeParams = field(default_factory=ModeParams, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.census is not None and self.census.resolution != self.mode_params.resolution and not self.census:
            self.census = CallCensus(self.mode_params.resolution)

    def add(self, summary: KernelSummary) -> None:
        """Add the rows of one summary of this (kernel, stream). Raises :class:`DetectorError` for another key
        or inconsistent cluster columns."""
        if (summary.kernel, summary.stream) != (self.kernel, self.stream):
            raise DetectorError(f"summary of {summary.kernel}/{summary.stream} added to {self.kernel}/{self.stream}")
        if len(summary.n_clusters) != len(summary.rank) or sum(summary.n_clusters) != len(summary.cluster_count):
            raise DetectorError(f"kernel summary {summary.job_id}/{summary.kernel}: cluster columns do not match")
        at = 0
        for rank, k in zip(summary.rank, summary.n_clusters, strict=True):
            clusters = slice(at, at + k)
            counts = summary.cluster_count[clusters]
            p99s, tops = summary.cluster_p99_ns[clusters], summary.cluster_max_ns[clusters]
            self.total_ns[rank] = self.total_ns.get(rank, 0.0) + sum(
                trimmed_sum(c, t, p99, top) for c, t, p99, top in zip(
                    counts, summary.cluster_sum_ns[clusters], p99s, tops, strict=True))
            self.calls[rank] = self.calls.get(rank, 0.0) + float(sum(counts))
            self.median_ns[rank] = self.median_ns.get(rank, 0.0) + float(sum(
                c * p for c, p in zip(counts, summary.cluster_p50_ns[clusters], strict=True)))
            self.peak_ns[rank] = max([self.peak_ns.get(rank, 0.0), *(
                counted_peak(c, p99, top) for c, p99, top in zip(counts, p99s, tops, strict=True))])
            at += k
        if self.census is not None:
            self.census.add(np.repeat(np.asarray(summary.rank, dtype=np.int64), summary.n_clusters),
                            summary.cluster_p50_ns, summary.cluster_count)

    def merge(self, other: KernelTotals) -> None:
        """Add another part's totals of this (kernel, stream). A rank's ``median_ns`` and ``peak_ns`` stay known
        only while every part that added to it knew them. Raises :class:`DetectorError` for another key."""
        if (other.kernel, other.stream) != (self.kernel, self.stream):
            raise DetectorError(f"totals of {other.kernel}/{other.stream} merged into {self.kernel}/{self.stream}")
        if self.census is not None and other.census is not None:
            self.census.merge(other.census)
        else:  # a part without a census (read from a context): the moves each part found add up
            moves = self.moved_calls()
            for r, (a, b) in other.moved_calls().items():
                held = moves.get(r, (0.0, 0.0))
                moves[r] = (held[0] + a, held[1] + b)
            self.moved, self.census = moves, None
        for r, v in other.total_ns.items():
            _merge_known(self.median_ns, other.median_ns, r, r in self.total_ns, lambda a, b: a + b)
            _merge_known(self.peak_ns, other.peak_ns, r, r in self.total_ns, max)
            self.total_ns[r] = self.total_ns.get(r, 0.0) + v
            self.calls[r] = self.calls.get(r, 0.0) + other.calls.get(r, 0.0)

    def moved_calls(self) -> dict[int, tuple[float, float]]:
        """Per rank that moved calls up out of its modes: (calls moved, its peers' calls in those modes)
        (:func:`~argus.detectors.call_modes.moved_calls`; from the census when here, else as a context carried
        them)."""
        return moved_calls(self.census, self.mode_params) if self.census is not None else dict(self.moved)


class MovedCalls:
    """The calls each rank moved up out of its modes, per (kernel, stream) of ``totals``
    (:meth:`KernelTotals.moved_calls`, computed on first use), for the share of the steps a result's excess
    was spent in."""

    def __init__(self, totals: Iterable[KernelTotals]) -> None:
        self._totals = {(t.kernel, t.stream): t for t in totals}
        self._held: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}

    def share(self, rank: int, keys: Iterable[tuple[str, int]]) -> float:
        """:func:`~argus.detectors.call_modes.affected_share` of ``rank`` over the kernels ``keys``."""
        return affected_share(self._of(k).get(rank) for k in keys)

    def _of(self, key: tuple[str, int]) -> dict[int, tuple[float, float]]:
        if key not in self._held:
            t = self._totals.get(key)
            self._held[key] = t.moved_calls() if t is not None else {}
        return self._held[key]


def _merge_known(mine: dict[int, float], theirs: dict[int, float], rank: int, seen: bool,
                 combine: Callable[[float, float], float]) -> None:
    """Combine ``rank``'s value of another part into ``mine``: known only while every part that added to the
    rank knew it (``seen``: an earlier part added to it)."""
    if rank in theirs and (not seen or rank in mine):
        mine[rank] = combine(mine[rank], theirs[rank]) if rank in mine else theirs[rank]
    else:
        mine.pop(rank, None)


@dataclass(frozen=True)
class RankExcessParams:
    """Thresholds of :func:`detect_rank_excess` (defaults in brackets).

    ``slower_ratio``: a rank's mean time per call of a kernel over the set's median that counts it slower
    in that kernel [1.1]. Significance: the z-score of the rank's summed normal scores (the kernels agree
    in direction) at least ``min_order_z`` [2.0], and either the z-score of its time-weighted shift over its
    kernels (against the kernels' spread over the set's ranks) or, in some kernel subset (all, or one
    family), both the summed normal scores' z-score and the subset's median kernel ``typical_ratio`` [1.15]
    slower reach the Bonferroni bound of ``alpha`` [0.01] over the tests of its set (its ranks x kernel
    subsets: 3.5 for 8 ranks, 4.4 for 256) and at least ``min_z`` [3.0] (``min_z_two_ranks`` [4.5] in a
    set of two, whose time test reads its GEMM, attention and norm kernels only).
    ``min_excess_fraction``: least share of its expected compute time it spends beyond its peers in
    those kernels [0.1]. ``min_ranks``: fewest ranks of a comparison set [2]. ``min_kernels``: fewest kernels
    a rank must share with its set [3]. ``top_kernels``: kernels named in the evidence [5].
    ``collective_markers``: lower-case substrings of collective kernels, left out [("nccl",)].
    ``stage_min_excess``: least excess of a pipeline stage over the others, as a share of its expected time,
    in :func:`detect_stage_excess` [0.1].
    :func:`~argus.detectors.kernel_excess.detect_kernel_excess`: a kernel's time over what its rank's speed
    predicts must be at least ``kernel_min_ratio`` [1.05] with a z-score of at least ``kernel_min_z`` [4.0]
    (and the Bonferroni bound of ``alpha``), in kernels of at least ``kernel_min_calls`` [8] calls per rank,
    with at least ``kernel_min_kernels`` [5] such kernels to tell the rank's speed.
    """

    min_z: float = 3.0
    min_z_two_ranks: float = 4.5
    alpha: float = 0.01
    min_order_z: float = 2.0
    typical_ratio: float = 1.15
    stage_min_excess: float = 0.1
    min_excess_fraction: float = 0.1
    slower_ratio: float = 1.1
    min_ranks: int = 2
    min_kernels: int = 3
    top_kernels: int = 5
    collective_markers: tuple[str, ...] = ("nccl",)
    kernel_min_ratio: float = 1.05
    kernel_min_z: float = 4.0
    kernel_min_calls: int = 8
    kernel_min_kernels: int = 5
    #: Least spread of the ranks' excess fractions (a set of identical ranks has none) [0.01].
    fraction_floor: float = 0.01
    #: Fewest ranks of a set whose excess fractions, or whose times in one kernel, have a spread of their own to
    #: judge a rank's against; a stage with fewer is also compared job-wide [5].
    spread_ranks: int = 5
    #: Kernels that must run slower on a stage for it to be slow (a name or two may run another shape there)
    #: [3].
    stage_min_slower_kernels: int = 3
    #: Least z-score (over the slower kernels' noise) of the excess of a stage slow in one phase only [4.0].
    stage_min_z: float = 4.0
    #: Calls per rank a kernel needs to count in the stage comparison (a one-step trace is no stage verdict)
    #: [4].
    stage_min_calls: int = 4
    #: :func:`~argus.detectors.kernel_excess.detect_kernel_excess`: least noise of a kernel's log time per call
    #: (0.1 %), so identical ranks give no infinite z [1e-3].
    kernel_scale_floor: float = 1e-3
    #: Most spread of a kernel's calls over the compared ranks (in :func:`detect_stage_excess`, over the stages'
    #: medians) that still counts as the same work [0.02].
    same_calls: float = 0.02
    #: Floor of the spread (log scale) of a stage's kernels' ratios to the other stages', which sets the noise
    #: of a stage slow in one phase only [0.005].
    stage_spread_floor: float = 0.005
    #: :func:`~argus.detectors.kernel_excess.detect_kernel_excess`: fewest calls that must carry a kernel's
    #: excess (its excess over the longest call's) for the plain total to stand without the median total's
    #: corroboration: a few hiccups cannot, a slowed shape merged into a cluster of others does [4].
    kernel_carried_calls: float = 4.0
    #: :func:`~argus.detectors.kernel_excess.detect_kernel_excess`, grouped GEMMs of EP groups of different
    #: pipeline stages compared: least share of its group's excess that a member's time over its group's other
    #: members' median must cover to be the one named (a slow member of an even share covers about all of it)
    #: [0.75].
    carrier_share: float = 0.75
    #: Least excess fraction (as ``min_excess_fraction``) a rank must show without its kernel of largest excess:
    #: a slow GPU slows its kernels broadly, while one stray call (x2-5, a few ms) makes a kernel's whole excess
    #: in a short trace [0.05].
    spread_excess_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_z) and self.min_z >= 0.0 and 0.0 <= self.min_excess_fraction < 1.0
                and 0.0 <= self.spread_excess_fraction < 1.0 and self.slower_ratio > 1.0 and 0.0 < self.alpha < 1.0):
            raise DetectorError("need min_z >= 0, alpha in (0, 1), min_excess_fraction and spread_excess_fraction "
                                "in [0, 1) and slower_ratio > 1")
        if self.min_ranks < 2 or self.min_kernels < 1 or self.top_kernels < 1:
            raise DetectorError("need min_ranks >= 2, min_kernels >= 1 and top_kernels >= 1")
        if self.spread_ranks < 2 or self.stage_min_slower_kernels < 1 or self.stage_min_calls < 1:
            raise DetectorError("need spread_ranks >= 2, stage_min_slower_kernels >= 1 and stage_min_calls >= 1")
        if not (self.fraction_floor > 0.0 and self.kernel_scale_floor > 0.0 and math.isfinite(self.stage_min_z)
                and self.stage_min_z >= 0.0 and 0.0 <= self.same_calls < 1.0 and self.stage_spread_floor > 0.0):
            raise DetectorError("need fraction_floor > 0, kernel_scale_floor > 0, stage_spread_floor > 0, "
                                "stage_min_z >= 0 and same_calls in [0, 1)")
        if not (self.kernel_min_ratio >= 1.0 and self.kernel_min_z >= 0.0 and self.kernel_min_calls >= 1
                and self.kernel_min_kernels >= 3 and self.kernel_carried_calls >= 2.0
                and 0.0 < self.carrier_share <= 1.0):
            raise DetectorError("need kernel_min_ratio >= 1, kernel_min_z >= 0, kernel_min_calls >= 1, "
                                "kernel_min_kernels >= 3, kernel_carried_calls >= 2 and carrier_share in (0, 1]")


def detect_rank_excess(totals: Iterable[KernelTotals], topology: JobTopology | None = None,
                       params: RankExcessParams | None = None) -> list[L3Result]:
    """Ranks slower than their peers across the job's compute kernels (see the module docstring).

    ``totals``: one :class:`KernelTotals` per (kernel, stream) of the job. ``topology``: ranks are compared
    within their pipeline stage when given, else across the job. One result per flagged rank, with
    ``kernel`` = the kernel carrying most of its excess and ``excess_ns`` = its total excess time.
    """
    p = params if params is not None else RankExcessParams()
    # An expert-parallel job's grouped GEMMs run each rank's routed tokens: a hot expert's rank spends longer
    # in them without being slow. Its speed is read on the dense kernels; its grouped GEMMs are judged per
    # token or per EP group (argus.detectors.kernel_excess).
    routed = topology is not None and topology.ep_size >= 2
    totals = list(totals)
    usable = [t for t in totals if t.calls and not is_collective(t.kernel, p.collective_markers)
              and not (routed and is_grouped_gemm(t.kernel))]
    if not usable:
        return []
    ranks, total, calls, part, _ = totals_matrix(usable, topology)
    keys = [(t.kernel, t.stream) for t in usable]
    out: list[L3Result] = []
    for label, rows, cols, judged in comparison_sets(part, calls, p):
        named = {r.ranks[0] for r in out}
        found = _judge_peeling(ranks[rows], total[np.ix_(rows, cols)], calls[np.ix_(rows, cols)],
                               [keys[j] for j in cols.tolist()], label, p)
        out += [r for r in found if judged[int(np.searchsorted(ranks[rows], r.ranks[0]))] and r.ranks[0] not in named]
    moves = MovedCalls(usable)
    out = [with_share(r, moves.share(r.ranks[0], keys)) for r in out]
    if routed and topology is not None:
        out = [_with_routed_excess(r, [t for t in totals if t.calls and is_grouped_gemm(t.kernel)], topology)
               for r in out]
    return out


def _with_routed_excess(result: L3Result, routed: Sequence[KernelTotals], topology: JobTopology) -> L3Result:
    """A rank named slow across its dense kernels, with the time its grouped GEMMs take over its EP group's other
    members' median added to its excess (``routed_excess_ms``), each at most what its slower kernels' ratio
    (``slower_kernels_ratio``) predicts of that kernel: a slow GPU runs its experts slow too, which the rank's
    speed, read on the dense kernels, leaves out of its impact; a popular expert's extra tokens are routing and
    add no more than that."""
    rank, ratio = result.ranks[0], float(result.evidence.get("slower_kernels_ratio", 1.0))
    ranks, group = topology.array("rank"), topology.array("ep_group")
    at = np.flatnonzero(ranks == rank)
    if not at.size or ratio <= 1.0:
        return result
    peers = ranks[(group == group[at[0]]) & (ranks != rank)].tolist()
    extra = 0.0
    for t in routed:
        own = t.total_ns.get(rank)
        others = [t.total_ns[r] for r in peers if r in t.total_ns]
        if own is None or not others:
            continue
        extra += min(max(own - float(np.median(others)), 0.0), own * (1.0 - 1.0 / ratio))
    if extra <= 0.0:
        return result
    return dataclasses.replace(result, excess_ns=result.excess_ns + extra,
                               evidence=result.evidence | {"routed_excess_ms": extra / 1e6})


def with_share(result: L3Result, share: float) -> L3Result:
    """``result`` with the share of the steps its excess was spent in (also in its evidence)."""
    return dataclasses.replace(result, affected_share=share, evidence=result.evidence | {"affected_share": share})


def set_speeds(log_per_call: F64) -> F64:
    """Per rank (rows of ``log_per_call``: ranks x kernels, ln of time per call), its speed against the set:
    the median over its kernels of its value less every rank's median there (ln; one reference for all ranks,
    so two ranks' speeds differ by their own difference)."""
    return np.asarray(np.median(log_per_call - np.median(log_per_call, axis=0), axis=1), dtype=np.float64)


def totals_matrix(totals: Sequence[KernelTotals], topology: JobTopology | None) -> tuple[I64, F64, F64, I64, F64]:
    """The job's ranks (ascending), their total time and calls per kernel (ranks x kernels, NaN time and 0
    calls where a rank does not run it), each rank's comparison part (its pipeline stage with a
    topology, -1 for a rank outside it; all 0 without) and their median time per kernel (NaN where a rank
    does not run it or its median time is unknown)."""
    ranks = np.array(sorted({r for t in totals for r in t.calls}), dtype=np.int64)
    pos = {r: i for i, r in enumerate(ranks.tolist())}
    total = np.full((ranks.size, len(totals)), np.nan)
    median = np.full((ranks.size, len(totals)), np.nan)
    calls = np.zeros((ranks.size, len(totals)))
    for k, t in enumerate(totals):
        for r, c in t.calls.items():
            if c > 0:
                total[pos[r], k], calls[pos[r], k] = t.total_ns.get(r, 0.0), c
                median[pos[r], k] = t.median_ns.get(r, math.nan)
    if topology is not None:
        stage_of = dict(zip(topology.rank, topology.pp_stage, strict=True))
        part = np.array([stage_of.get(r, -1) for r in ranks.tolist()], dtype=np.int64)
    else:
        part = np.zeros(ranks.size, dtype=np.int64)
    return ranks, total, calls, part, median


def comparison_sets(part: I64, calls: F64, p: RankExcessParams, also: Iterable[int] = ()
                    ) -> list[tuple[int, I64, I64, npt.NDArray[np.bool_]]]:
    """The sets of ranks compared with each other, as ``(label, rows, kernel columns, judged)``: each part
    (pipeline stage) of at least ``min_ranks`` ranks over every kernel, labelled by the part; and, when
    some part has fewer than five ranks or is named in ``also``, every rank over the kernels all ranks run
    with the same calls, labelled -1, where only those parts' ranks (``judged``, per row of the set) are
    judged."""
    every = np.arange(calls.shape[1], dtype=np.int64)
    out = []
    stages, sizes = np.unique(part, return_counts=True)
    for g in stages.tolist():
        rows = np.flatnonzero(part == g)
        if rows.size >= p.min_ranks:
            out.append((int(g), rows, every, np.ones(rows.size, dtype=bool)))
    small = np.union1d(stages[sizes < p.spread_ranks], np.intersect1d(stages, np.fromiter(also, np.int64)))
    if small.size and stages.size >= 2:
        # Stages of a few ranks have little to compare with, but their transformer layers run the same
        # kernels as every other stage's: the kernels every rank runs, with the same calls, compare job-wide.
        shared = (calls > 0).all(axis=0) & (calls.min(axis=0) == calls.max(axis=0))
        if int(shared.sum()) >= p.min_kernels:
            out.append((-1, np.arange(part.size, dtype=np.int64), np.flatnonzero(shared), np.isin(part, small)))
    return out


#: Families whose kernels' work is fixed by their shapes, alike on every rank of a data-parallel set.
_SHAPE_FAMILIES = ("gemm", "attention", "norm")
#: Kernel families by name (lower case, first match): a fault often slows one family, e.g. the GEMMs.
_FAMILIES = (("gemm", ("gemm", "xmma", "cutlass", "cublas", "matmul", "wgmma", "nvjet")),
             ("attention", ("flash", "attn", "fmha", "softmax")),
             ("norm", ("norm",)),
             ("embedding", ("embedding", "embed")),
             ("elementwise", ("elementwise", "vectorized", "unrolled")),
             ("reduce", ("reduce",)))


def kernel_family(kernel: str) -> str:
    """The family of a kernel name: gemm, attention, norm, embedding, elementwise, reduce or other."""
    # FBGEMM's kernels (embedding tables, index permutes, quantization) carry "fbgemm" in their names and
    # template arguments, and are no GEMMs.
    low = kernel.lower().replace("fbgemm", "")
    # The function's own name first: its template arguments name what it is built of (FlashAttention's
    # kernels take cutlass types, a reduction its norm functor), not what it does.
    base = _family_of(low.split("<", 1)[0])
    return base if base != "other" else _family_of(low)


def _family_of(low: str) -> str:
    return next((fam for fam, needles in _FAMILIES if any(n in low for n in needles)), "other")


def _time_z(d: F64, weight: F64, present: npt.NDArray[np.bool_], family: I64) -> F64:
    """Per row of ``d`` (ranks x kernels: log time per call over the reference, 0 where absent): the
    ``weight``-ed (expected time) mean of its deviations over the noise of that mean, with each kernel's noise
    the spread of its deviations over the ranks (1.4826 MAD, floored at 0.02). Of a pair, whose deviations
    mirror each other (the spread over the ranks is the shift itself), the spread of the row's deviations
    around the median of their kernel ``family`` (a fault may shift one family and spare the others)."""
    w = np.where(present, weight, 0.0)
    if d.shape[0] >= 3:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a kernel no rank runs: no spread, no weight
            masked = np.where(present, d, np.nan)
            centre = np.nanmedian(masked, axis=0)
            sigma = np.nan_to_num(MAD_SCALE * np.nanmedian(np.abs(masked - centre), axis=0))[None, :]
    else:
        sigma = np.zeros((d.shape[0], 1))
        for i in range(d.shape[0]):
            row, fam = d[i][present[i]], family[present[i]]
            if row.size:
                labels, at = np.unique(fam, return_inverse=True)
                centre = np.array([np.median(row[at == j]) for j in range(labels.size)])[at]
                sigma[i, 0] = MAD_SCALE * float(np.median(np.abs(row - centre)))
    sigma = np.maximum(sigma, 0.02)
    total = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out: F64 = (w * d).sum(axis=1) / np.sqrt(((w * sigma) ** 2).sum(axis=1))
    return np.where(total > 0, np.nan_to_num(out), 0.0)


def _rank_scores_z(d: F64) -> F64:
    """Per row of ``d`` (ranks x kernels, NaN where absent): the z-score of its summed normal scores.

    In each kernel the ranks are ranked by ``d`` (ties share their mean rank) and a rank's score is
    ``Phi^-1((rank - 0.5) / n)``; if no rank differed, which rank holds which score would be a random
    permutation, independently per kernel, so a row's centred sum has variance the sum of each kernel's
    permutation variance. Rank-based: calibrated whatever the durations' noise, skew or quantization."""
    present = ~np.isnan(d)
    n = present.sum(axis=0)
    ranks = rankdata(np.where(present, d, np.inf), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        score = np.where(present, ndtri((ranks - 0.5) / np.maximum(n, 1)), 0.0)
        centre = score.sum(axis=0) / np.maximum(n, 1)
        dev = np.where(present, score - centre, 0.0)
        var = (dev * dev).sum(axis=0) / np.maximum(n, 1)
        out: F64 = dev.sum(axis=1) / np.sqrt(np.where(present, var, 0.0).sum(axis=1))
    return np.nan_to_num(out, nan=0.0)


def _judge_peeling(ranks: I64, total: F64, calls: F64, keys: Sequence[tuple[str, int]], part: int,
                   p: RankExcessParams) -> list[L3Result]:
    """:func:`_judge` on the set, then again on the ranks it did not flag, until a round flags none.

    A slow rank masks another: two ranks equally slow in a set of four take the top two places of every
    kernel, and the second place scores well under the first (its order z ~1.6 where the first's is ~8),
    while the pair lifts its peers' median. Judged again without the ranks already flagged (as the
    generalized ESD test removes an outlier and tests the next), the second is the first of the rest. Each
    round holds its ranks to the bar of the whole set's tests. If most of the set is flagged it is the
    set's work that changed, not a rank: nothing is named."""
    out: list[L3Result] = []
    rows = np.arange(ranks.size)
    while rows.size >= p.min_ranks:
        found = _judge(ranks[rows], total[rows], calls[rows], keys, part, p, ranks.size)
        if not found:
            break
        out += found
        if 2 * len(out) > ranks.size:
            return []
        rows = rows[~np.isin(ranks[rows], [r.ranks[0] for r in found])]
    return out


def _judge(ranks: I64, total: F64, calls: F64, keys: Sequence[tuple[str, int]], part: int,
           p: RankExcessParams, n_tests: int) -> list[L3Result]:
    present = calls > 0
    enough = present.sum(axis=0) >= p.min_ranks
    total, calls, present = total[:, enough], calls[:, enough], present[:, enough]
    keys = [k for k, ok in zip(keys, enough.tolist(), strict=True) if ok]
    if not keys:
        return []
    d, ref, positive = _shifts(total, calls, present)
    slower = positive & (d > math.log(p.slower_ratio))
    significant, pooled = _significant(d, ref * calls, positive, [k for k, _ in keys], ranks.size, p, n_tests)
    w = np.where(positive, ref * calls, 0.0)
    share = (w * slower).sum(axis=1) / np.maximum(w.sum(axis=1), 1e-300)
    per_call = np.where(positive, total / np.where(positive, calls, 1.0), 0.0)
    expected = np.where(positive, calls * ref, 0.0).sum(axis=1)
    extra = np.where(slower, calls * (per_call - ref), 0.0)
    excess = extra.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        fraction = excess / expected
        # The same without each rank's kernel of largest excess (a slow GPU's excess is spread over kernels).
        top = np.argmax(extra, axis=1)[:, None]
        rest = (excess - np.take_along_axis(extra, top, axis=1)[:, 0]) / (
            expected - np.take_along_axis(w, top, axis=1)[:, 0])
    # The excess must also stand out of its peers' excesses: in a short trace a few long kernels carry the
    # time, and their noise alone gives some healthy rank of a large set a tenth or more. (A few ranks have
    # no spread to judge by: there the rank-based z stands alone.)
    apart = np.ones(ranks.size, dtype=bool)
    if ranks.size >= p.spread_ranks:
        spread = max(MAD_SCALE * float(np.median(np.abs(fraction - np.median(fraction)))), p.fraction_floor)
        apart = (fraction - np.median(fraction)) / spread >= float(ndtri(1.0 - p.alpha / ranks.size))
    hit = (significant & (fraction >= p.min_excess_fraction) & (rest >= p.spread_excess_fraction) & apart
           & (positive.sum(axis=1) >= p.min_kernels))
    if not hit.any() or 2 * int(hit.sum()) > ranks.size:
        return []
    out = []
    for i in np.flatnonzero(hit).tolist():
        order = np.argsort(-extra[i], kind="stable")[: p.top_kernels]
        top = [j for j in order.tolist() if extra[i, j] > 0]
        kernel, stream = keys[top[0]] if top else keys[0]
        out.append(L3Result(FindingKind.RANK_DEGRADED, (int(ranks[i]),), kernel, stream, float(fraction[i]), {
            "rank_score_z": float(pooled[i]), "kernels_slower": int(slower[i].sum()),
            "excess_fraction": float(fraction[i]), "excess_ms": float(excess[i]) / 1e6,
            "expected_ms": float(expected[i]) / 1e6, "kernels_compared": int(positive[i].sum()),
            "slower_time_share": float(share[i]), "partition": part,
            "slower_kernels_ratio": 1.0 + float(fraction[i]) / max(float(share[i]), 1e-12),
            "n_ranks": int(ranks.size),
            "top_kernels_excess_ms": {f"{keys[j][0]}@{keys[j][1]}": float(extra[i, j]) / 1e6 for j in top},
            "top_kernels_ratio": {f"{keys[j][0]}@{keys[j][1]}": float(math.exp(d[i, j])) for j in top},
        }, excess_ns=float(excess[i])))
    return out


def _shifts(total: F64, calls: F64, present: npt.NDArray[np.bool_]) -> tuple[F64, F64, npt.NDArray[np.bool_]]:
    """Per rank and kernel (``present``: the rank runs it): ``ln`` of its time per call over its peers' median
    (leave-one-out: with two ranks, the other one; 0 where unknown), that median (ns per call; 0 where unknown)
    and where both are known."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(present, total / np.where(present, calls, 1.0), np.nan)
        positive = present & (mean > 0)
        logm = np.where(positive, np.log(np.where(positive, mean, 1.0)), np.nan)
    ref_log = np.full(logm.shape, np.nan)
    for k in range(logm.shape[1]):
        rows = np.flatnonzero(positive[:, k])
        if rows.size >= 2:
            ref_log[rows, k] = loo_median(logm[rows, k])
    positive &= ~np.isnan(ref_log)
    d = np.where(positive, logm - np.nan_to_num(ref_log), 0.0)
    ref = np.where(positive, np.exp(np.nan_to_num(ref_log)), 0.0)
    return d, ref, positive


def _significant(d: F64, weight: F64, positive: npt.NDArray[np.bool_], kernels: list[str], n_ranks: int,
                 p: RankExcessParams, n_tests: int) -> tuple[npt.NDArray[np.bool_], F64]:
    """Per rank, whether its shifts ``d`` (``weight``: each kernel's expected time, ns) are significant (module
    docstring), and its best rank-score z over the kernel subsets (all, and each family)."""
    masked = np.where(positive, d, np.nan)
    fams = [kernel_family(k) for k in kernels]
    subsets, labels = [np.ones(len(fams), dtype=bool)], ["all"]
    for fam in sorted(set(fams)):  # a fault often hits one family (the GEMMs): test it undiluted by the rest too
        cols = np.array([f == fam for f in fams])
        if p.min_kernels <= int(cols.sum()) < len(fams):
            subsets.append(cols)
            labels.append(fam)
    orders = np.array([_rank_scores_z(masked[:, c]) for c in subsets])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without kernels in a subset: no shift
        typical = np.nan_to_num(np.array([np.nanmedian(masked[:, c], axis=1) for c in subsets]), nan=0.0)
    # Every rank is tested in every subset: the z a rank needs grows with the tests (Bonferroni), so a set of
    # eight ranks is not held to the bar of a thousand, nor a thousand to that of eight.
    min_z = max(p.min_z if n_ranks >= 3 else p.min_z_two_ranks,
                float(ndtri(1.0 - p.alpha / (n_tests * len(subsets)))))
    # Significance (see the module docstring): the order with the typical kernel's shift, or the shift in time.
    # Of two ranks only the kernels whose shapes fix their work compare; the slower one is then named (GPUs
    # of one job are alike, and the excess share below keeps a few percent apart silent).
    pair = n_ranks < 3
    counted = np.array([not pair or fam in _SHAPE_FAMILIES for fam in labels])
    timed_cols = np.isin(fams, _SHAPE_FAMILIES) if pair else np.ones(len(fams), dtype=bool)
    timed = _time_z(d, weight, positive & timed_cols[None, :], np.unique(fams, return_inverse=True)[1]) >= min_z
    significant = (((orders >= min_z) | ((orders >= p.min_order_z) & timed[None, :]))
                   & (typical >= math.log(p.typical_ratio)) & counted[:, None]).any(axis=0)
    return significant, orders.max(axis=0)


def detect_stage_excess(totals: Iterable[KernelTotals], topology: JobTopology,
                        params: RankExcessParams | None = None, exclude: Iterable[int] = ()) -> list[L2Result]:
    """Pipeline stages slower than the others in the compute kernels they share.

    The pipeline's own schedule hides a slow stage from per-rank comparisons (all of its ranks are slow
    alike) and its waiting spreads to the other stages, but compute kernels do not wait: per kernel that every
    stage runs with the same calls per rank (the layers' kernels; the first and last stages' embedding and
    output layer differ and are left out), each stage's time per call on its lower-quartile rank (a slow
    stage slows all of its ranks, a straggler only itself; a quartile is steadier than the fastest rank) is
    compared with the other stages' median of that. A stage whose excess over the others,
    ``sum(calls * (m - ref))`` over its kernels, is at least ``stage_min_excess`` of its expected time is an
    :attr:`~argus.detectors.l2_phases.FindingKind.PP_STAGE_SLOW` finding naming its ranks (score: 1 + that
    share), with phase ``gpu_kernels``; so is one slow in one phase only (its backward), whose
    ``slower_ratio`` slower kernels hold ``stage_min_excess`` of its expected time, their excess over its other
    kernels ``stage_min_z`` times their noise, and its excess over all kernels positive. ``delay_ns_per_step``
    is left to the caller (totals have no steps; evidence ``stage_delay_ms``: the stage's median compute time
    with the excess share taken out, times that share -- what the slow stage adds to the pipeline over the
    totals) and ``steps_affected`` 0. The excess must not rest on a couple of kernels (a name that runs
    another shape on one stage): at least 3 kernels run ``slower_ratio`` slower.
    ``exclude``: ranks left out of the stage medians (the slow ranks found by :func:`detect_rank_excess`: one
    slow rank of a small stage is no slow stage).
    """
    p = params if params is not None else RankExcessParams()
    skip = set(exclude)
    stage_of = {r: st for r, st in zip(topology.rank, topology.pp_stage, strict=True) if r not in skip}
    stages = sorted(set(topology.pp_stage))
    if len(stages) < 2:
        return []
    rows, compute = _stage_kernels(totals, stage_of, stages, p)
    if len(rows) < p.min_kernels:
        return []
    m = np.stack([r[1] for r in rows])  # kernels x stages
    n = np.stack([r[2] for r in rows])
    out = []
    for j, stage in enumerate(stages):
        others = np.median(np.delete(m, j, axis=1), axis=1)
        ratio = m[:, j] / others
        expected = float((n[:, j] * others).sum())
        excess = float((n[:, j] * (m[:, j] - others)).sum())  # signed: noise of few calls cancels
        if not _stage_is_slow(ratio, n[:, j] * others, expected, excess, p):
            continue
        median_ratio = 1.0 + excess / expected
        ranks = tuple(int(r) for r, st in zip(topology.rank, topology.pp_stage, strict=True) if st == stage)
        # The kernels compared are the layers' share of the stage's work; the rest of it (kernels other
        # stages do not run alike) is taken to run as much slower: the stage's delay on the pipeline.
        own = [compute[r] for r in ranks if r in compute]
        stage_ns = float(np.median(own)) if own else expected + excess
        delay = max(stage_ns, expected + excess) * (excess / expected) / median_ratio
        top = np.argsort(-(n[:, j] * (m[:, j] - others)))[: p.top_kernels]
        out.append(L2Result(FindingKind.PP_STAGE_SLOW, ranks, "gpu_kernels", median_ratio, {
            "stage": int(stage), "phase_kind": "gpu_kernels", "stage_over_other_stages_ratio": median_ratio,
            "excess_fraction": excess / expected, "excess_ms": excess / 1e6, "kernels_compared": len(rows),
            "stage_compute_ms": stage_ns / 1e6, "stage_delay_ms": delay / 1e6,
            "top_kernels_ratio": {rows[k][0]: float(ratio[k]) for k in top.tolist()},
        }, delay_ns_per_step=0.0, steps_affected=0))
    if 2 * len(out) > len(stages):
        return []  # most stages "slow": no stage stands out
    return out


def _stage_kernels(totals: Iterable[KernelTotals], stage_of: dict[int, int], stages: list[int], p: RankExcessParams
                   ) -> tuple[list[tuple[str, F64, F64]], dict[int, float]]:
    """The compute kernels every stage runs alike: (kernel, per stage its fastest rank's time per call (ns), per
    stage its ranks' median calls), and per rank of ``stage_of`` its time (ns) in every compute kernel."""
    rows: list[tuple[str, F64, F64]] = []
    compute: dict[int, float] = {}
    for t in totals:
        if is_collective(t.kernel, p.collective_markers):
            continue
        for r, v in t.total_ns.items():
            if r in stage_of:
                compute[r] = compute.get(r, 0.0) + v
        per_call: dict[int, list[float]] = {s: [] for s in stages}
        calls: dict[int, list[float]] = {s: [] for s in stages}
        for r, c in t.calls.items():
            if c > 0 and r in stage_of:
                per_call[stage_of[r]].append(t.total_ns.get(r, 0.0) / c)
                calls[stage_of[r]].append(c)
        if any(not calls[s] for s in stages):
            continue
        med_calls = np.array([float(np.median(calls[s])) for s in stages])
        if med_calls.max() > (1.0 + p.same_calls) * med_calls.min() or med_calls.min() < p.stage_min_calls:
            continue  # not the same work on every stage, or too few calls for a stage-wide verdict
        # A stage's lower-quartile rank: a slow stage slows every one of its ranks, a straggler only itself.
        rows.append((t.kernel, np.array([float(np.percentile(per_call[s], 25)) for s in stages]), med_calls))
    return rows, compute


def _stage_is_slow(ratio: F64, weight: F64, expected: float, excess: float, p: RankExcessParams) -> bool:
    """Whether a stage whose kernels run ``ratio`` x the other stages' (``weight``: each kernel's expected time,
    ns, summing to ``expected``) with ``excess`` ns beyond them is slow (see :func:`detect_stage_excess`)."""
    slow = ratio >= p.slower_ratio
    if expected <= 0 or int(np.sum(slow)) < p.stage_min_slower_kernels:
        return False
    if excess / expected >= p.stage_min_excess:
        return True
    # A stage slow in one phase (its backward) slows that phase's kernels only: over every kernel its
    # excess is diluted by its other phases', and more where the heaviest kernels of that phase are not
    # compared (a GEMM name the last stage's output layer also runs). It counts too where its slower kernels
    # hold a phase's worth of its expected time (``stage_min_excess`` of it), the stage is not faster over
    # all, and their excess over the stage's other kernels stands ``stage_min_z`` beyond noise: the kernels'
    # spread, read below their median log ratio (noise spreads both ways; a slow phase moves its kernels up
    # and leaves the lower half as it was), over the slower kernels' effective number.
    d = np.log(ratio)
    below = d[d <= np.median(d)]
    spread = max(MAD_SCALE * float(np.median(np.median(d) - below)), p.stage_spread_floor)
    base = float(np.median(ratio[~slow])) if not slow.all() else 1.0
    own = float((weight[slow] * (ratio[slow] - base)).sum())
    noise = spread * float(np.sqrt((weight[slow] ** 2).sum()))
    return (float(weight[slow].sum()) >= p.stage_min_excess * expected and excess > 0.0
            and own >= p.stage_min_z * noise)
