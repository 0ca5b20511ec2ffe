"""L2 diagnosis: which rank is the straggler, in which phase, comparing ranks only within their groups.

Input is a :class:`PhaseTable` (per rank, step and phase: the summed duration and the count). A compute phase
is judged by its own time (less the blocking TP/EP/PP collectives that overlap it) against the rank's DP group, a
collective against the group of its own kind; :func:`detect_l2` returns :class:`L2Result` s, with the
thresholds in :class:`L2Params`.

Details and reasoning: docs/internals/detectors.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.l2_compare import Flag, phase_flags
from argus.detectors.l2_groups import cell_median, loo_median
from argus.detectors.phase_layout import BLOCKING_GROUPS, COMPUTE_KINDS, LayoutIndex
from argus.detectors.victims import waiting_victims
from argus.schemas.records import JobTopology, Level, ParallelGroup, PhaseBatch, PhaseKind

__all__ = ["BLOCKING_GROUPS", "L2Params", "L2Result", "PhaseStats", "PhaseTable", "detect_l2", "judge_l2", "loo_median",
           "phase_stats", "rank_positions"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
_MS = 1e6
#: Blocking groups whose members wait for each other inside a layer, so look slow together (not PP: its
#: members are stages, which wait for each other across the step and are judged as stages).
_WAIT_TOGETHER = tuple(sorted(BLOCKING_GROUPS - {ParallelGroup.PP}, key=lambda g: g.value))
#: Late arrivals alike in one of these groups are late together: a blocking group's members waited in it, and the
#: members of one DP group in different TP groups share its collectives only (a degraded DP link delays them all).
_LATE_TOGETHER = (*_WAIT_TOGETHER, ParallelGroup.DP)
_COMPUTE = COMPUTE_KINDS


#: A stage's phase flagged slow: its ratio to the other stages, per-occurrence ms of every stage, ns per step.
_StageHit = tuple[float, dict[str, float], float]


@dataclass(frozen=True)
class L2Params:
    """Thresholds of :func:`detect_l2` (defaults in brackets).

    ``min_elevation``: a phase's value over its peers' median that flags a rank [1.5].
    ``min_z``: least robust z-score, applied in groups of 3+ [3.5]. ``mad_floor``: floor of the z-score's
    scale as a fraction of the peers' median, so near-identical peers do not make any wobble infinite
    [0.02]. ``collective_ratio``: peers' median over a member's collective time that names a late
    arrival [3.0]. ``min_late_fraction``: least lateness per step, as a
    fraction of the rank's longest phase per step (a step-level timer such as forward-backward, where
    there is one), of a late arrival named without an elevated compute phase; 0.5 matches the 1.5x of
    ``min_elevation`` [0.5]. ``stage_ratio``: a pipeline stage's per-occurrence mean
    over the other stages' median [1.5]. ``stage_kinds``: phase kinds of the cross-stage check
    [(BACKWARD,)]. ``min_steps``: fewest analysed steps for any result [3].

    Raises :class:`DetectorError` for out-of-range values.
    """

    min_elevation: float = 1.5
    min_z: float = 3.5
    mad_floor: float = 0.02
    collective_ratio: float = 3.0
    min_late_fraction: float = 0.5
    stage_ratio: float = 1.5
    stage_kinds: tuple[PhaseKind, ...] = (PhaseKind.BACKWARD,)
    min_steps: int = 3
    #: A member's collective time this many times shorter than its group peers' flags it as the late arrival
    #: (the last to arrive waits for nobody; its peers waited for it) [2.0].
    late_arrival_ratio: float = 2.0
    #: Of a compute phase's own excess over its peers, the least share by which its duration (waiting included)
    #: must exceed theirs: a rank whose wall time is not longer made nobody wait [0.5].
    wall_share: float = 0.5
    #: Two-member groups of a phase needed to judge one pair's difference against the others' [3].
    min_pairs: int = 3
    #: Least z of a pair's difference against the other pairs'. Healthy pairs' differences are the absolute
    #: values of a normal, but their scale is read from a median of a few dozen: of 400 jobs of 32 pairs of GPUs
    #: 2.5 % apart, a bar of 4.5 named a pair in 2, 5.5 in none, and still finds a member 1.3x slower (~40 % of
    #: the time for 1.2x, which is L3's to find per kernel) [5.5].
    pair_min_z: float = 5.5
    #: Family-wise false-alarm rate over a phase's pairs: the pairs' bar grows with them (Bonferroni) [0.01].
    pairs_alpha: float = 0.01
    #: A late arrival that spent this share of its lateness in its own blocking collectives (more than its peers
    #: did) waited there, for a degraded link or a late TP partner: no straggler [0.5].
    waited_explains: float = 0.5
    #: A late arrival that spent under this share of its lateness waiting in blocking collectives is late of
    #: itself [0.2].
    waited_own: float = 0.2
    #: Among members of one blocking group flagged alike, one this much more elevated than the next is the
    #: cause [1.3].
    stands_out: float = 1.3
    #: Least share of a straggler's largest phase excess that a phase needs to name its finding (the most
    #: elevated such phase does): a short phase (an optimizer step of a millisecond on a CPU-starved rank) may
    #: be more elevated than the one that holds the slowdown [0.1].
    name_share: float = 0.1

    def __post_init__(self) -> None:
        for name in ("min_elevation", "collective_ratio", "stage_ratio", "late_arrival_ratio", "stands_out"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 1.0):
                raise DetectorError(f"{name} must be finite and > 1, got {value}")
        if not (math.isfinite(self.min_z) and self.min_z >= 0.0 and 0.0 < self.mad_floor < 1.0):
            raise DetectorError("min_z must be finite and >= 0, mad_floor in (0, 1)")
        if not (math.isfinite(self.min_late_fraction) and self.min_late_fraction >= 0.0):
            raise DetectorError(f"min_late_fraction must be finite and >= 0, got {self.min_late_fraction}")
        if self.min_steps < 1:
            raise DetectorError(f"min_steps must be >= 1, got {self.min_steps}")
        if self.min_pairs < 2 or not (math.isfinite(self.pair_min_z) and self.pair_min_z >= 0.0):
            raise DetectorError(f"need min_pairs >= 2 and pair_min_z >= 0, got {self.min_pairs}, {self.pair_min_z}")
        if not 0.0 <= self.name_share <= 1.0:
            raise DetectorError(f"name_share must be in [0, 1], got {self.name_share}")
        if not 0.0 < self.pairs_alpha < 1.0:
            raise DetectorError(f"pairs_alpha must be in (0, 1), got {self.pairs_alpha}")
        for name in ("wall_share", "waited_explains", "waited_own"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise DetectorError(f"{name} must be finite and >= 0, got {value}")


@dataclass(frozen=True)
class L2Result:
    """One L2 finding: ``ranks`` (one straggler, or a slow stage's ranks), the ``phase`` name, a unitless
    ``score`` (elevation over peers, shortness ratio, or stage ratio) and ``evidence`` (units in keys)."""

    kind: FindingKind
    ranks: tuple[int, ...]
    phase: str
    score: float
    evidence: dict[str, Any] = field(default_factory=dict)
    #: Always empty: L2 findings are about ranks, not steps.
    steps: tuple[int, ...] = ()
    #: Time (ns) per step the finding adds to the job's iteration: the rank's (or stage's) time beyond its
    #: peers' median in its elevated phases, or its lateness for a late arrival.
    delay_ns_per_step: float = 0.0
    #: Steps the finding was judged on.
    steps_affected: int = 0

    @property
    def level(self) -> Level:
        return self.kind.level


@dataclass(frozen=True, eq=False)
class PhaseTable:
    """Columnar phase durations: one row per (rank, step, phase), unique.

    ``phase[i]`` indexes the phase dictionary ``names`` / ``kinds`` / ``groups`` (one entry per distinct
    (name, kind, group)); ``duration_ns[i]`` is the summed duration of that phase in the step, ``count[i]``
    its occurrences, ``nested_ns[i]`` the time of *blocking* collectives (group kind in
    :data:`BLOCKING_GROUPS`) overlapping it (compute phases only, else 0; zeros when not given). Build it with
    :meth:`from_batches`. Raises :class:`DetectorError` for mismatched columns or phase indices outside
    the dictionary.
    """

    rank: I64
    step: I64
    phase: I64
    duration_ns: I64
    count: I64
    names: tuple[str, ...]
    kinds: tuple[PhaseKind, ...]
    groups: tuple[ParallelGroup, ...]
    nested_ns: I64 | None = None

    def __post_init__(self) -> None:
        cols = ("rank", "step", "phase", "duration_ns", "count", "nested_ns")
        if self.nested_ns is None:
            object.__setattr__(self, "nested_ns", np.zeros(np.asarray(self.rank).size, dtype=np.int64))
        arrays = [np.asarray(getattr(self, c), dtype=np.int64) for c in cols]
        if any(a.ndim != 1 or a.size != arrays[0].size for a in arrays):
            raise DetectorError("PhaseTable columns must be equally long 1-D integer arrays")
        if not len(self.names) == len(self.kinds) == len(self.groups):
            raise DetectorError("PhaseTable names, kinds and groups must be equally long")
        if arrays[0].size and (int(arrays[2].min()) < 0 or int(arrays[2].max()) >= len(self.names)):
            raise DetectorError("PhaseTable.phase indexes outside the phase dictionary")
        for name, a in zip(cols, arrays, strict=True):
            a.flags.writeable = False
            object.__setattr__(self, name, a)

    def __len__(self) -> int:
        return int(self.rank.size)

    @property
    def own_ns(self) -> I64:
        """``duration_ns`` less the blocking collectives nested in it (the phase's own work)."""
        nested = self.nested_ns if self.nested_ns is not None else 0
        out: I64 = np.maximum(self.duration_ns - nested, 0)
        return out

    @classmethod
    def from_batches(cls, batches: Iterable[PhaseBatch]) -> PhaseTable:
        """Aggregate PhaseBatches (any ranks, steps and order) per (rank, step, phase).

        A (rank, step) delivered twice (at-least-once delivery) counts once: the last batch wins.
        ``nested_ns`` of a compute phase sums the overlap of its ``[start, start + duration)`` with
        every collective of a group kind in :data:`BLOCKING_GROUPS` of the same batch (capped at its duration).
        """
        every = list(batches)
        at_of = map(attrgetter("rank", "step"), every)
        latest: dict[tuple[int, int], PhaseBatch] = dict(zip(at_of, every, strict=True))
        index = LayoutIndex()
        which, folded = index.fold(list(latest.values()))
        names = tuple(k[0] for k in index.keys)
        kinds = tuple(k[1] for k in index.keys)
        groups = tuple(k[2] for k in index.keys)
        if not latest:
            empty = np.empty(0, dtype=np.int64)
            return cls(empty, empty, empty, empty, empty, names, kinds, groups)
        # Rows: per batch (in the order of ``latest``) one per phase id of its layout, in id order.
        size = np.array([lay.ids.size for lay in index.layouts], dtype=np.int64)[which]
        first = np.cumsum(size) - size
        cols = {c: np.empty(int(size.sum()), dtype=np.int64) for c in ("phase", "duration", "count", "nested")}
        for part in folded:
            lay = index.layouts[part.layout]
            at_rows = (first[part.members][:, None] + np.arange(lay.ids.size)).ravel()
            cols["phase"][at_rows] = np.tile(lay.ids, part.members.size)
            cols["count"][at_rows] = np.tile(lay.counts, part.members.size)
            cols["duration"][at_rows] = part.duration.ravel()
            cols["nested"][at_rows] = part.nested.ravel()
        rank = np.repeat(np.fromiter((k[0] for k in latest), dtype=np.int64, count=len(latest)), size)
        step = np.repeat(np.fromiter((k[1] for k in latest), dtype=np.int64, count=len(latest)), size)
        return cls(rank, step, cols["phase"], cols["duration"], cols["count"], names, kinds, groups, cols["nested"])


def detect_l2(phases: PhaseTable, topology: JobTopology, params: L2Params | None = None,
              onset_step: int | None = None) -> list[L2Result]:
    """Stragglers by phase within parallel groups, and slow pipeline stages (see the module docstring).

    ``phases``: the job's phase table; only steps ``>= onset_step`` are analysed when it is given (use
    L1's regression onset). ``params`` defaults to ``L2Params()``. Returns compute stragglers (one per
    rank, named by its most elevated phase of those holding ``name_share`` of its largest excess), phase
    stragglers, then slow stages. Raises :class:`DetectorError` for ranks missing from ``topology``.
    """
    p = params if params is not None else L2Params()
    keep = np.ones(len(phases), dtype=bool) if onset_step is None else phases.step >= onset_step
    n_analysed = int(np.unique(phases.step[keep]).size)
    if n_analysed < p.min_steps:
        return []
    compute = np.array([k in _COMPUTE for k in phases.kinds], dtype=bool)
    rows = np.flatnonzero(keep & compute[phases.phase]) if compute.size else np.empty(0, dtype=np.int64)
    stats = phase_stats(phases.rank[keep], phases.phase[keep], phases.own_ns[keep], phases.count[keep], n_analysed,
                        (phases.names, phases.kinds, phases.groups), topology,
                        raw=(phases.rank[rows], phases.phase[rows], np.maximum(phases.duration_ns[rows], 0)))
    return judge_l2(stats, topology, p)


@dataclass(frozen=True, eq=False)
class PhaseStats:
    """What :func:`judge_l2` reads of the analysed steps, per (rank's position in the topology, phase):
    steps that have the phase (``n_steps``), the median own time per step (``per_step``, ns; NaN where
    none) and the mean occurrences per step (``occ``; NaN where none), all ``world x phases``; the phase
    dictionary (``names``, ``kinds``, ``groups``) and the number of analysed steps (``n_analysed``).
    ``raw_medians(k, positions)``: the median duration per step of phase ``k``, blocking collectives included,
    at those rank positions (any shape); ``None``: the own time, as where nothing nests. Only the groups where
    a compute phase flags a member read it (:meth:`raw`), so it is taken on demand."""

    names: tuple[str, ...]
    kinds: tuple[PhaseKind, ...]
    groups: tuple[ParallelGroup, ...]
    n_steps: I64
    per_step: F64
    occ: F64
    n_analysed: int
    raw_medians: Callable[[int, I64], F64] | None = None

    def raw(self, k: int, positions: I64) -> F64:
        """Phase ``k``'s median duration per step (ns, waiting included) at rank ``positions``."""
        if self.raw_medians is None:
            out: F64 = self.per_step[positions, k]
            return out
        return self.raw_medians(k, positions)


def rank_positions(topology: JobTopology, rank: I64) -> I64:
    """Each rank's position in ``topology`` (the last of equal ranks), by one search. Raises
    :class:`DetectorError` for ranks missing from it."""
    out, found = topology.positions(rank)
    if not found.all():
        raise DetectorError(f"ranks {np.unique(np.asarray(rank)[~found]).tolist()[:5]} are not in topology "
                            f"{topology.job_id}")
    return out


def phase_stats(rank: I64, pid: I64, own: I64, count: I64, n_analysed: int,
                dictionary: tuple[tuple[str, ...], tuple[PhaseKind, ...], tuple[ParallelGroup, ...]],
                topology: JobTopology, raw: tuple[I64, I64, I64] | None = None) -> PhaseStats:
    """:class:`PhaseStats` of table rows (one per (rank, step, phase) analysed: ``pid`` indexes
    ``dictionary``; ``own`` ns, ``count`` occurrences). ``raw``: (rank, pid, duration ns) rows of the cells
    whose duration may differ from their own time, every analysed step of each (other cells' raw median is
    their own). Raises :class:`DetectorError` for ranks missing from ``topology``."""
    rpos = rank_positions(topology, rank)
    world, n_phases = len(topology.rank), len(dictionary[0])
    cell = rpos * n_phases + pid
    size = world * n_phases
    n_steps = np.bincount(cell, minlength=size).reshape(world, n_phases)
    # Median over steps, not the mean: real jobs have warm-up steps and pauses (GC, checkpoint) that would
    # otherwise make one rank's mean look elevated.
    per_step = cell_median(cell, own.astype(np.float64), size).reshape(world, n_phases)
    with np.errstate(invalid="ignore", divide="ignore"):
        occ = np.bincount(cell, weights=count, minlength=size).reshape(world, n_phases) / n_steps
    if raw is None or not raw[0].size:
        return PhaseStats(*dictionary, n_steps, per_step, occ, n_analysed)

    @functools.cache
    def raw_step() -> F64:
        raw_cell = rank_positions(topology, raw[0]) * n_phases + raw[1]
        flat = per_step.ravel().copy()
        at = np.unique(raw_cell)
        flat[at] = cell_median(raw_cell, raw[2].astype(np.float64), size)[at]
        out: F64 = flat.reshape(world, n_phases)
        return out

    def raw_at(k: int, positions: I64) -> F64:
        out: F64 = raw_step()[positions, k]
        return out

    return PhaseStats(*dictionary, n_steps, per_step, occ, n_analysed, raw_at)


def judge_l2(stats: PhaseStats, topology: JobTopology, p: L2Params) -> list[L2Result]:
    """The findings of :func:`detect_l2` from the analysed steps' :class:`PhaseStats` (at least
    ``p.min_steps`` of them)."""
    n_steps, per_step, occ = stats.n_steps, stats.per_step, stats.occ
    longest = np.where(n_steps > 0, per_step, 0.0).max(axis=1)
    blocking = np.array([k.is_collective and g in BLOCKING_GROUPS for k, g in zip(stats.kinds, stats.groups,
                                                                                  strict=True)], dtype=bool)
    in_blocking = np.where(n_steps > 0, per_step, 0.0)[:, blocking].sum(axis=1)  # per step
    compute_flags: list[Flag] = []
    host_flags: list[Flag] = []
    short_flags: list[Flag] = []
    ranks = topology.array("rank")
    elevation = np.full(per_step.shape, np.nan)  # compute phases: every rank's ratio to its peers
    def raw(k: int) -> Callable[[I64], F64]:
        return lambda positions: stats.raw(k, positions)

    for k in range(len(stats.names)):
        kind, gkind = stats.kinds[k], stats.groups[k]
        collective = kind.is_collective
        gkind = gkind if collective else ParallelGroup.DP
        if collective and gkind is ParallelGroup.PP and kind is not PhaseKind.SEND_RECV:
            # A reduction over a group that spans the pipeline's stages: which stage reaches it last is the
            # schedule's doing (the first stage ends its backward last), not a late member.
            continue
        column = topology.array((ParallelGroup.DP if gkind is ParallelGroup.NONE else gkind).column)
        target = short_flags if collective else compute_flags if kind in _COMPUTE else host_flags
        target += phase_flags(stats.names[k], kind, gkind.value, column, n_steps[:, k] > 0, per_step[:, k],
                              occ[:, k], longest, in_blocking, ranks, p, raw(k),
                              elevation[:, k] if kind in _COMPUTE else None)
    phase_of = {name: k for k, name in enumerate(stats.names)}
    results, stragglers = _stragglers(compute_flags, short_flags, host_flags, topology, p,
                                      lambda phase: elevation[:, phase_of[phase]])
    results += _slow_stages(per_step, occ, n_steps, stats, topology, stragglers, p, in_blocking > 0)
    return [dataclasses.replace(r, steps_affected=stats.n_analysed) for r in results]


def _by_rank(flags: list[Flag]) -> dict[int, list[Flag]]:
    out: dict[int, list[Flag]] = {}
    for f in sorted(flags, key=lambda f: -abs(math.log(f.ratio))):  # strongest first
        out.setdefault(f.rank, []).append(f)
    return out


def _named_phase(flags: list[Flag], share: float) -> Flag:
    """Of one rank's elevated phases (most elevated first), the one that names its finding: the most elevated
    of those whose excess is at least ``share`` of the largest."""
    most = max(f.excess_ns for f in flags)
    return next((f for f in flags if f.excess_ns >= share * most), flags[0])


def _evidence(top: Flag, flags: list[Flag]) -> dict[str, Any]:
    return {
        "phase_kind": top.kind.value, "rank_ms": top.value_ns / _MS, "peers_median_ms": top.peers_ns / _MS,
        "elevation_ratio": top.ratio, "robust_z": top.z, "group_cv": top.cv, "group": top.group,
        "elevated_phases_ratio": {f"{f.phase}:{f.kind.value}": f.ratio for f in flags},
    }


def _stragglers(compute: list[Flag], short: list[Flag], host: list[Flag], topology: JobTopology,
                p: L2Params, elevation: Callable[[str], F64] | None = None) -> tuple[list[L2Result], set[int]]:
    by_rank, shorts = _by_rank(compute), _by_rank(short)
    slow = set(by_rank)
    victims = waiting_victims(slow, set(shorts), topology)

    def named_late(fs: list[Flag]) -> bool:
        return any(1.0 / f.ratio >= p.collective_ratio and f.late_fraction >= p.min_late_fraction
                   and f.waited_fraction < p.waited_explains for f in fs)

    late = {r for r, fs in shorts.items() if r in slow or (r not in victims and named_late(fs))}
    # A late arrival whose lateness is its own (it hardly waited in blocking collectives) held up the ranks
    # it shares a blocking group with: those that arrived late *because* they waited there are its victims
    # (a pipeline neighbour of a straggler reaches its DP all-reduce late too).
    own = {r for r in late - slow if min(f.waited_fraction for f in shorts[r]) < p.waited_own}
    late -= waiting_victims(slow | own, {r for r in late - slow - own}, topology)
    together = _waited_together({r: fs[0].ratio for r, fs in by_rank.items()}, topology, p.stands_out,
                                None if elevation is None else {r: elevation(fs[0].phase) for r, fs in by_rank.items()})
    together |= _waited_together({r: 1.0 / fs[0].ratio for r, fs in shorts.items() if r not in by_rank}, topology,
                                 p.stands_out, groups=_LATE_TOGETHER)
    slow -= together
    late -= together
    results: list[L2Result] = []
    for r in sorted(slow | late):
        flags, short_fs = by_rank.get(r, []), shorts.get(r, [])
        top = _named_phase(flags, p.name_share) if flags else short_fs[0]
        evidence = _evidence(top, flags) | {
            "collective_short": bool(short_fs),
            "short_collectives_peers_over_rank_ratio": {f"{f.phase}:{f.kind.value}": 1.0 / f.ratio for f in short_fs},
            "late_arrival_only": not flags,
            "lateness_over_longest_phase_ratio": max((f.late_fraction for f in short_fs), default=0.0),
        }
        score = top.ratio if flags else 1.0 / top.ratio
        # Elevated phases of one rank run one after the other: their excesses add up; a late arrival's
        # lateness is what its peers waited.
        delay = sum(f.excess_ns for f in flags) if flags else max(f.excess_ns for f in short_fs)
        results.append(L2Result(FindingKind.COMPUTE_STRAGGLER, (r,), top.phase, score, evidence,
                                delay_ns_per_step=max(delay, 0.0)))
    for r, fs in sorted(_by_rank(host).items()):
        results.append(L2Result(FindingKind.PHASE_STRAGGLER, (r,), fs[0].phase, fs[0].ratio, _evidence(fs[0], fs),
                                delay_ns_per_step=max(sum(f.excess_ns for f in fs), 0.0)))
    return results, slow | late


def _causes(found: dict[int, dict[tuple[str, str], _StageHit]]) -> dict[int, dict[tuple[str, str], _StageHit]]:
    """The slow stages that are causes, not victims: a backward runs from the last stage to the first, so a
    stage waiting for a slow later stage's gradients looks slow too; only the latest flagged stage of a
    backward-kind phase is named (the earliest for any other kind: a forward's activations flow first to
    last)."""
    keep: dict[int, dict[tuple[str, str], _StageHit]] = {}
    for key in {key for per_phase in found.values() for key in per_phase}:
        stages = sorted(s for s, per_phase in found.items() if key in per_phase)
        cause = stages[-1] if key[1] == PhaseKind.BACKWARD.value else stages[0]
        keep.setdefault(cause, {})[key] = found[cause][key]
    return keep


def _waited_together(elevation: dict[int, float], topology: JobTopology, stands_out: float,
                     peers: dict[int, F64] | None = None,
                     groups: tuple[ParallelGroup, ...] = _WAIT_TOGETHER) -> set[int]:
    """Compute stragglers that are members of one blocking group (TP, EP) flagged alike: the members of a
    group that waited in its blocking collectives for one of them (or for a degraded link) all look slow in
    the phase around it, when the phase cannot be told from the waiting (phases without nested collective
    records, e.g. imported traces). None of them is named here unless one stands out (its elevation
    ``stands_out`` x the next member's); the compute kernels find the cause. The same holds for members
    that reached a later collective late together. ``elevation``: per flagged rank, its top ratio (> 1).
    ``peers``: per flagged rank, every rank's ratio in that rank's top phase (NaN where not compared, by
    position in ``topology``): members elevated alike but just under the flagging ratio count as the next
    member too (a degraded TP link puts a whole group at ~1.5x, and which of them crosses 1.5x is noise).
    ``groups``: the kinds of group read."""
    flagged = list(elevation)
    pos = dict(zip(flagged, rank_positions(topology, np.array(flagged, dtype=np.int64)).tolist(), strict=True))
    out: set[int] = set()
    for group in groups:
        column = topology.array(group.column)
        members: dict[int, list[int]] = {}
        for r in elevation:
            members.setdefault(int(column[pos[r]]), []).append(r)
        for g, ranks in members.items():
            ratios = sorted((elevation[r], r) for r in ranks)
            top_ratio, top = ratios[-1]
            out |= {r for _, r in ratios[:-1]}
            nxt = ratios[-2][0] if len(ratios) > 1 else 0.0
            if peers is not None:
                others = (column == g) & (np.arange(column.size) != pos[top])
                with np.errstate(invalid="ignore"):
                    nxt = max(nxt, float(np.nanmax(peers[top][others], initial=0.0)))
            if top_ratio < stands_out * nxt:
                out.add(top)
    return out


def _one_waiting_set(ranks: I64, topology: JobTopology) -> bool:
    """Whether the blocking groups inside a stage (TP, EP) join all of ``ranks`` (two or more): one slow rank
    among them holds up every other one, so their fastest rank no longer tells the stage's speed."""
    rest = set(ranks[1:].tolist())
    return ranks.size >= 2 and waiting_victims({int(ranks[0])}, rest, topology, _WAIT_TOGETHER) == rest


def _slow_stages(per_step: F64, occ: F64, n_steps: I64, phases: PhaseStats, topology: JobTopology,
                 stragglers: set[int], p: L2Params, waits_known: npt.NDArray[np.bool_]) -> list[L2Result]:
    """Pipeline stages slow as a whole (see the module docstring). ``waits_known``: per rank, whether its
    phases nest blocking collective records (its waiting is out of its own time). A stage none of whose
    ranks' waiting is known, and whose ranks one slow member holds up together (:func:`_one_waiting_set`),
    is only a baseline: its phases cannot tell a slow stage from a straggler nobody named (the kernel-level
    stage comparison, :func:`~argus.detectors.l3_ranks.detect_stage_excess`, can)."""
    stage = topology.array("pp_stage")
    stages = np.unique(stage)
    if stages.size < 2:
        return []
    rank_ids = topology.array("rank")
    blind = {s for s in stages.tolist()
             if not waits_known[stage == s].any() and _one_waiting_set(rank_ids[stage == s], topology)}
    # A straggler's TP and EP peers wait for it inside the layer (where no collective record tells the waiting
    # from the work, it is in their phase times), and their peers in turn: those ranks say nothing of their
    # stage's speed. A stage all of whose ranks are stragglers or such victims is a baseline, never a finding.
    waiting = waiting_victims(stragglers, set(topology.rank), topology, _WAIT_TOGETHER)
    excluded = np.isin(topology.array("rank"), sorted(stragglers | waiting))
    found: dict[int, dict[tuple[str, str], _StageHit]] = {}
    for k, kind in enumerate(phases.kinds):
        if kind not in p.stage_kinds:
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            per_occ = per_step[:, k] / occ[:, k]
        has = n_steps[:, k] > 0
        values, explained = {}, set()
        for s in stages.tolist():
            members = has & (stage == s)
            if not np.any(members & ~excluded):
                explained.add(s)
            use = members & ~excluded if s not in explained else members
            if use.any():
                # A slow stage slows every one of its ranks, a straggler (or an unknown one's victims) only some:
                # the stage's fastest rank tells its speed (a stage with one straggler is no slow stage).
                values[s] = float(np.nanmin(per_occ[use]))
        if len(values) < 2:
            continue
        for s, v in values.items():
            others = float(np.median([u for t, u in values.items() if t != s]))
            if s not in explained and s not in blind and others > 0 and v / others >= p.stage_ratio:
                rate = float(np.nanmedian(occ[has & (stage == s), k]))
                found.setdefault(s, {})[(phases.names[k], kind.value)] = (
                    v / others, {str(t): u / _MS for t, u in sorted(values.items())}, (v - others) * rate)
    results = []
    for s, per_phase in sorted(_causes(found).items()):
        top = max(per_phase, key=lambda key: per_phase[key][0])
        ratio, stage_ms, excess = per_phase[top]
        ranks = tuple(topology.array("rank")[stage == s].tolist())
        results.append(L2Result(FindingKind.PP_STAGE_SLOW, ranks, top[0], ratio, delay_ns_per_step=excess, evidence={
            "stage": int(s), "phase_kind": top[1], "stage_over_other_stages_ratio": ratio,
            "stage_per_occurrence_ms": stage_ms,
            "phases_ratio": {f"{name}:{kind}": v[0] for (name, kind), v in sorted(per_phase.items())},
        }))
    return results
