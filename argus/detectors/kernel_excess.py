"""L3 per (rank, kernel): one kernel slower on a rank than the rank's own speed predicts.

A fault often hits one shape of one kernel on one rank (a GEMM whose tile config fell back, a throttled
unit used by one op): the kernel name runs several shapes, so the slowed shape is one mode of a multimodal
kernel, and when its durations lie close to another shape's the KDE merges both into one cluster and the
shift is diluted (one shape x1.4 of three gives the cluster x1.1). Per-kernel W1 on one window does not see
a tenth; summed over the job's windows it is plain, once two things are taken out: see docs/internals/detectors.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from scipy.special import ndtri

from argus.core.kinds import FindingKind
from argus.detectors.experts import ep_group_ids, group_means, is_grouped_gemm, per_token_scale
from argus.detectors.l2_groups import MAD_SCALE, loo_median_rows
from argus.detectors.l3_kernels import L3Result, is_collective
from argus.detectors.l3_ranks import (
    KernelTotals,
    MovedCalls,
    RankExcessParams,
    comparison_sets,
    set_speeds,
    totals_matrix,
    with_share,
)
from argus.schemas.records import JobTopology

__all__ = ["detect_kernel_excess"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]



def detect_kernel_excess(totals: Iterable[KernelTotals], topology: JobTopology | None = None,
                         params: RankExcessParams | None = None, exclude: Iterable[int] = (),
                         expert_tokens: Mapping[int, int] | None = None) -> list[L3Result]:
    """Ranks with kernels slower than their own speed predicts (see the module docstring).

    ``totals``: one :class:`KernelTotals` per (kernel, stream) of the job, with ``median_ns`` (ranks
    without it are left out of a kernel). ``topology``: ranks are compared within their pipeline stage
    (small stages job-wide in the kernels every rank shares) when given, else across the job.
    ``exclude``: ranks not to name (already named slow across kernels). ``expert_tokens``: per rank, the
    tokens routed to its experts over the same steps (grouped GEMMs are then compared per token). One result
    per named rank.
    """
    p = params if params is not None else RankExcessParams()
    usable = [t for t in totals if t.calls and not is_collective(t.kernel, p.collective_markers)]
    if not usable:
        return []
    ranks, total, calls, part, median = totals_matrix(usable, topology)
    peak = _peaks(usable, ranks)
    keys = [(t.kernel, t.stream) for t in usable]
    moves = MovedCalls(usable)
    skip = set(exclude)
    out: dict[int, L3Result] = {}
    routed = np.array([is_grouped_gemm(k) for k, _ in keys], dtype=bool)
    groups = ep_group_ids(topology, ranks)
    lone = _lone_group_stages(part, groups)
    stages, sizes = np.unique(part, return_counts=True)
    wide = stages[sizes >= p.spread_ranks]
    for label, rows, cols, judged in comparison_sets(part, calls, p, also=lone):
        # A stage of one EP group compares its grouped GEMMs with other stages' groups (the same layers' shapes
        # and tokens); its dense kernels are judged within its stage.
        dense_judged = ~np.isin(part[rows], wide) if label == -1 else None
        moe = _Experts(routed[cols], per_token_scale(ranks[rows], expert_tokens),
                       None if groups is None else groups[rows], dense_judged)
        cells = np.ix_(rows, cols)
        for res in _judge(ranks[rows], _Cells(total[cells], median[cells], peak[cells], calls[cells]),
                          [keys[j] for j in cols.tolist()], label, p, moe, moves):
            r = res.ranks[0]
            if r in skip or r in out or not judged[int(np.searchsorted(ranks[rows], r))]:
                continue
            out[r] = res
    return [out[r] for r in sorted(out)]


def _lone_group_stages(part: I64, group: I64 | None) -> list[int]:
    """The pipeline stages whose ranks form fewer than two EP groups of two or more (their grouped GEMMs have
    no other group of their stage to be compared with); none without expert parallelism."""
    if group is None:
        return []
    out = []
    for stage in np.unique(part[part >= 0]).tolist():
        _, counts = np.unique(group[(part == stage) & (group >= 0)], return_counts=True)
        if int((counts >= 2).sum()) < 2:
            out.append(int(stage))
    return out


def _peaks(totals: Sequence[KernelTotals], ranks: I64) -> F64:
    """Ranks x kernels: the longest call as the totals count it (NaN where unknown)."""
    pos = {r: i for i, r in enumerate(ranks.tolist())}
    out = np.full((ranks.size, len(totals)), np.nan)
    for k, t in enumerate(totals):
        for r, v in t.peak_ns.items():
            if r in pos:
                out[pos[r], k] = v
    return out


@dataclass(frozen=True)
class _Cells:
    """One comparison set's ranks x kernels: total time, cluster-median time and longest counted call (ns, NaN
    where unknown), and calls."""

    total: F64
    median: F64
    peak: F64
    calls: F64


@dataclass(frozen=True)
class _Experts:
    """How one comparison set's grouped GEMMs are read: ``routed`` per kernel column; ``scale`` per rank (time
    to time per token, :func:`~argus.detectors.experts.per_token_scale`; None: tokens unknown); ``group`` per
    rank (its EP group; None without expert parallelism); ``dense_judged``: see the field."""

    routed: npt.NDArray[np.bool_]
    scale: F64 | None
    group: I64 | None
    #: Per rank: whether its kernels other than the routed ones are judged here (None: all are, and the set is
    #: one pipeline stage, whose EP groups run the same layers).
    dense_judged: npt.NDArray[np.bool_] | None = None

    def per_token(self, values: F64, cols: I64) -> F64:
        """``values`` (ranks x ``cols``) with the routed columns per token where the tokens are known."""
        if self.scale is None or not self.routed[cols].any():
            return values
        out = values.copy()
        out[:, self.routed[cols]] *= self.scale[:, None]
        return out

    def conserved(self, cols: I64) -> npt.NDArray[np.bool_]:
        """Per column of ``cols``: judged on EP-group means (routed, tokens unknown, expert parallelism)."""
        if self.scale is not None or self.group is None:
            return np.zeros(cols.size, dtype=bool)
        return np.asarray(self.routed[cols], dtype=bool)


def _residuals(per_call: F64, calls: F64, p: RankExcessParams, pooled_only: npt.NDArray[np.bool_] | None = None,
               members: F64 | None = None) -> tuple[F64, F64, F64]:
    """The two-way model's residuals, their z-scores and the ranks' speeds (log), for ranks x kernels (the
    noise floored at ``p.kernel_scale_floor``, a kernel's own spread read from ``p.spread_ranks`` ranks on);
    ``pooled_only``: kernels whose noise is the pooled scale alone (EP-group means: a few distinct values,
    whose own spread is the difference being judged); ``members``: per rank, how many members' mean its
    values in those kernels are (the mean of ``m`` members carries ``1/sqrt(m)`` of one member's noise)."""
    x = np.log(per_call)
    n = x.shape[0]
    ref = loo_median_rows(x.T).T  # each rank against its peers' median, kernel by kernel
    y = x - ref
    speed = np.median(y, axis=1, keepdims=True)
    e = y - speed
    c = np.median(calls, axis=0)
    widen = np.sqrt(np.maximum(np.median(c) / c, 1.0))  # fewer calls than the median kernel: a noisier mean
    pooled = MAD_SCALE * float(np.median(np.abs(e) / widen))
    scale = np.maximum(pooled * widen, p.kernel_scale_floor)
    if n >= p.spread_ranks:
        own = MAD_SCALE * np.median(np.abs(e - np.median(e, axis=0)), axis=0)
        if pooled_only is not None:
            own = np.where(pooled_only, 0.0, own)
        scale = np.maximum(scale, own)
    if pooled_only is not None and members is not None and pooled_only.any():
        cell = np.broadcast_to(scale, e.shape).copy()
        cell[:, pooled_only] = np.maximum(pooled * widen[pooled_only] / np.sqrt(members)[:, None],
                                          p.kernel_scale_floor)
        return e, e / cell, speed[:, 0]
    return e, e / scale, speed[:, 0]


def _judge(ranks: I64, cells: _Cells, keys: Sequence[tuple[str, int]], part: int, p: RankExcessParams,
           moe: _Experts, moves: MovedCalls) -> list[L3Result]:
    n = ranks.size
    total, median, calls = cells.total, cells.median, cells.calls
    same = ((calls >= p.kernel_min_calls).all(axis=0)
            & (calls.max(axis=0) <= (1.0 + p.same_calls) * calls.min(axis=0))
            & (total > 0).all(axis=0) & (np.nan_to_num(median) > 0).all(axis=0))
    if n < p.min_ranks or int(same.sum()) < p.kernel_min_kernels:
        return []
    cols = np.flatnonzero(same)
    c = calls[:, cols]
    tot, med = moe.per_token(total[:, cols], cols), moe.per_token(median[:, cols], cols)
    e_plain, z_plain, speed = _residuals(tot / c, c, p)
    e_median, z_median, _ = _residuals(med / c, c, p)
    conserved = moe.conserved(cols)
    e = e_plain
    if conserved.any():
        read = _group_scores(tot, med, c, conserved, moe.group, p, same_layers=moe.dense_judged is None)
        z_plain, z_median, keep = read.z_plain, read.z_median, read.keep
        # A routed kernel is sized by its group's excess carried by the member named (its time over its time
        # less that excess: a slow member's factor, whatever its share of the tokens), not by its time over its
        # peers' (a hot expert's is routing).
        group_excess = read.group_total * -np.expm1(-read.e)
        with np.errstate(divide="ignore", invalid="ignore"):
            carried_e = -np.log1p(-np.clip(group_excess / tot, None, 0.99))
        e = np.where(conserved, carried_e, e_plain)
    else:
        keep = np.ones_like(z_plain, dtype=bool)
    if moe.dense_judged is not None:
        keep[np.ix_(~moe.dense_judged, ~moe.routed[cols])] = False
    z = z_plain
    bound = max(p.kernel_min_z if n >= 3 else p.min_z_two_ranks, float(ndtri(1.0 - p.alpha / (n * cols.size))))
    # The size and its significance are the plain total's (a routed kernel's: its EP group's mean); the median
    # total, or an excess no few calls can carry, corroborates (module docstring).
    # Of two ranks each one's residuals mirror the other's (a slow GEMM on one reads as the other's slower
    # everything else once its speed is taken out): there both totals are held to the bound.
    corroborate = float(ndtri(1.0 - p.alpha)) if n >= 3 else bound
    carried = _carried_calls(total[:, cols], cells.peak[:, cols], c, e_plain) if n >= 3 else np.zeros_like(z)
    carried[:, moe.routed[cols]] = 0.0  # per token or per group: a routed kernel's calls are not its peers'
    confirmed = (z_median >= corroborate) | (carried >= p.kernel_carried_calls)
    hit = (z >= bound) & confirmed & (e >= math.log(p.kernel_min_ratio)) & keep
    hit[:, 2 * hit.sum(axis=0) > n] = False  # slower on most ranks: the kernel's work changed, not a rank
    if not hit.any():
        return []
    extra = np.where(hit, tot * -np.expm1(-e), 0.0)
    out = []
    for i in np.flatnonzero(hit.any(axis=1)).tolist():
        order = [j for j in np.argsort(-extra[i], kind="stable").tolist() if hit[i, j]][: p.top_kernels]
        top = order[0]
        kernel, stream = keys[int(cols[top])]
        named = {f"{keys[int(cols[j])][0]}@{keys[int(cols[j])][1]}": j for j in order}
        out.append(L3Result(FindingKind.KERNEL_DEGRADED, (int(ranks[i]),), kernel, stream, float(np.expm1(e[i, top])), {
            "detector": "kernel_excess", "partition": part, "n_ranks": n, "kernels_compared": int(cols.size),
            "kernels_slower": int(hit[i].sum()), "rank_speed_ratio": float(math.exp(speed[i])),
            "excess_ms": float(extra[i].sum()) / 1e6, "z_bound": bound,
            "top_kernels_ratio": {k: float(math.exp(e[i, j])) for k, j in named.items()},
            "top_kernels_z": {k: float(z[i, j]) for k, j in named.items()},
            "top_kernels_median_z": {k: float(z_median[i, j]) for k, j in named.items()},
            "top_kernels_excess_ms": {k: float(extra[i, j]) / 1e6 for k, j in named.items()},
            "top_kernels_calls": {k: float(c[i, j]) for k, j in named.items()},
            "top_kernels_carried_calls": {k: float(carried[i, j]) for k, j in named.items()},
        }, excess_ns=float(extra[i].sum())))
        # The share of the steps its excess was spent in, from the calls its slowed kernels moved.
        moved = moves.share(int(ranks[i]), [keys[int(cols[j])] for j in np.flatnonzero(hit[i])])
        out[-1] = with_share(out[-1], min(moved, _spread_share(extra[i], med[i] * -np.expm1(-e_median[i]),
                                                               hit[i] & ~conserved)))
    return out


def _spread_share(excess: F64, median_excess: F64, cols: npt.NDArray[np.bool_]) -> float:
    """The share of a rank's calls a slowdown moved, from its kernels ``cols``: their excess in total time over
    their excess with each call at its cluster's median (ns, per kernel). A cluster holding a slowdown's calls
    together with those from before its onset (slower by less than the clusters' spread apart) has its median
    at the slowed calls' level where they are most: its every call then counts as slowed there, while the
    total holds the earlier calls at their old times. 1.0 where the median excess is not the larger (a
    slowdown from the start, or of fewer calls than the cluster's half, which leaves its median alone), and
    where the share would be under a half: a median moves only with most of its cluster's calls, so the
    medians moved for another reason (clusters of two shapes joined on one rank and not on its peers)."""
    spent, at_median = float(excess[cols].sum()), float(median_excess[cols].sum())
    return spent / at_median if at_median > spent >= 0.5 * at_median > 0.0 else 1.0


def _carried_calls(total: F64, peak: F64, calls: F64, e: F64) -> F64:
    """Ranks x kernels: the fewest calls that can carry each kernel's excess ``e`` (log) over what its rank's
    speed predicts, each adding at most its longest counted call's excess over the predicted mean (0 where
    that call is unknown). One or two hiccups carry theirs in one or two calls; a shape slowed in every step
    needs as many calls as it has slowed, however its cluster's median reads."""
    expected = total / calls / np.exp(e)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (total - calls * expected) / (peak - expected)
    return np.where(np.isfinite(out) & (peak > expected), out, 0.0)


class _GroupRead(NamedTuple):
    """A comparison set read with its routed kernels on EP-group means (ranks x kernels): the residuals (log),
    the plain and median z-scores, where a rank may be named, and each rank's group's total time (ns, at the
    rank's speed; the rank's own total in the other kernels)."""

    e: F64
    z_plain: F64
    z_median: F64
    keep: npt.NDArray[np.bool_]
    group_total: F64


def _group_scores(tot: F64, med: F64, c: F64, conserved: npt.NDArray[np.bool_], group: I64 | None,
                  p: RankExcessParams, same_layers: bool = True) -> _GroupRead:
    """The plain residuals and z-scores and the median z-scores with the ``conserved`` columns read as each
    rank's EP-group mean (the router conserves a group's tokens), and where a rank may be named: in those
    columns only the member of its group slowest against its position's median over the groups, and none where
    fewer than two groups compare (module docstring). Each rank's speed on the other kernels is taken out of
    the values a group's mean is made of and put back into each member's (a mean over members mixes their
    speeds, which the model takes out per rank: left in, two members' ordinary few-percent difference reads as
    their group's excess). ``same_layers``: the groups run the same layers (one pipeline stage); else the member
    named is the one alone carrying its group's excess (:func:`_sole_carriers`)."""
    assert group is not None
    own = _speeds(tot / c, ~conserved)[:, None]
    g_tot, enough = group_means(tot[:, conserved] / own, group)
    g_med, _ = group_means(med[:, conserved] / own, group)
    t2, m2 = tot.copy(), med.copy()
    t2[:, conserved], m2[:, conserved] = g_tot * own, g_med * own
    ids, sizes = np.unique(group, return_counts=True)
    members = np.where(group >= 0, sizes[np.searchsorted(ids, group)], 1).astype(np.float64)
    e_group, z_plain, _ = _residuals(t2 / c, c, p, conserved, members)
    _, z_median, _ = _residuals(m2 / c, c, p, conserved, members)
    whole = np.where(conserved, t2 * members[:, None], tot)
    keep = np.ones_like(z_plain, dtype=bool)
    if not bool(enough):
        keep[:, conserved] = False
        return _GroupRead(e_group, z_plain, z_median, keep, whole)
    if not same_layers:
        keep = _sole_carriers(tot[:, conserved] / c[:, conserved] / own, group, keep, conserved, p.carrier_share)
        return _GroupRead(e_group, z_plain, z_median, keep, whole)
    # Within a group the member named is the one slowest against the same position of the other groups (the
    # same expert: a hot expert is hot in every group), not the one with the most time (which may be the hot
    # expert, its group's slow member being a cold one).
    ids = np.unique(group[group >= 0])
    position = np.full(group.size, -1, dtype=np.int64)
    for g in ids.tolist():
        rows = np.flatnonzero(group == g)
        position[rows] = np.arange(rows.size)
    for j in np.flatnonzero(conserved).tolist():
        per_call = tot[:, j] / c[:, j] / own[:, 0]
        against = np.ones(group.size)
        for q in np.unique(position[position >= 0]).tolist():
            at = position == q
            against[at] = per_call[at] / np.median(per_call[at])
        for g in ids.tolist():
            rows = np.flatnonzero(group == g)
            top = rows[int(np.argmax(against[rows]))]
            keep[rows, j] = False
            keep[top, j] = True
    return _GroupRead(e_group, z_plain, z_median, keep, whole)


def _speeds(per_call: F64, dense: npt.NDArray[np.bool_]) -> F64:
    """Per rank (rows of ``per_call``), its time in the ``dense`` columns over every rank's median, its median
    over them (1 without such columns). One reference for all ranks: against each rank's peers (leaving it out),
    as the model's speeds are, two ranks of a pair of speeds read each other's difference twice."""
    if not dense.any():
        return np.ones(per_call.shape[0])
    return np.exp(set_speeds(np.log(per_call[:, dense])))


def _sole_carriers(per_call: F64, group: I64, keep: npt.NDArray[np.bool_], conserved: npt.NDArray[np.bool_],
                   share: float) -> npt.NDArray[np.bool_]:
    """``keep`` with the ``conserved`` columns (``per_call``: ranks x those columns, each rank's speed taken out)
    nameable only in the member of a group that alone can carry its group's excess: groups of different
    pipeline stages run different layers, whose experts hold no common positions, so a hot expert and a slow
    one are told apart only where one member's time over its group's other members' median covers ``share`` of
    the group's excess over the other groups (their means' median) and no other member's does: a slow member of
    an even share covers about all of it, a hot one covers its extra tokens. Else none of the group is named."""
    ids = np.unique(group[group >= 0])
    means = np.array([per_call[group == g].mean(axis=0) for g in ids.tolist()])
    out = keep.copy()
    cols = np.flatnonzero(conserved)
    for gi, g in enumerate(ids.tolist()):
        rows = np.flatnonzero(group == g)
        others = np.delete(means, gi, axis=0)
        for j in range(cols.size):
            excess = rows.size * (means[gi, j] - float(np.median(others[:, j])))
            over = per_call[rows, j] - loo_median_rows(per_call[rows, j][None, :])[0]
            carriers = rows[over >= share * excess]
            out[rows, cols[j]] = False
            if excess > 0 and carriers.size == 1:
                out[carriers[0], cols[j]] = True
    return out
