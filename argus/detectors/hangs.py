"""Hangs and silence of a job, from each rank's last heartbeat (or last step/phase): pure functions.

Given per rank what it was last seen doing (:class:`RankLiveness`), the job's topology and *now* (event
time), :func:`detect_hangs` names a stalled job (``job_stalled``), silent ranks (``rank_silent``) and, per
parallel group of a stalled job, the collective its members wait in and the ranks they wait for
(``hang_wavefront``); :func:`job_resumed` closes an episode. Results are :class:`HangResult`, thresholds
:class:`HangParams`.

The bounds and rules: docs/internals/detectors.md.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from argus.core.kinds import FindingKind
from argus.schemas.records import Heartbeat, JobTopology, Level, ParallelGroup, PhaseKind

__all__ = ["HangParams", "HangResult", "RankLiveness", "detect_hangs", "job_resumed"]

_NS = 1e9
_GROUP_COLUMNS = {g: g.column for g in (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.EP)}


@dataclass(frozen=True)
class HangParams:
    """Bounds of the hang detector.

    Attributes:
        stall_k: a job is stalled after this many median step times without a completed step (unitless).
        stall_floor_ns: ... but never before this long, ns (steps of a few ms jitter by more than k of them).
        heartbeat_interval_ns: the ranks' heartbeat interval, ns (``Settings.heartbeat_interval_s``).
        silent_heartbeats: a rank is silent after at least this many heartbeat intervals without a record.
        lost_step_bounds: stall bounds (of worker time) that a job whose heartbeats name a step begun after one
            not yet read completed is left unjudged: its steps topic is read behind the heartbeats (a backlog, a
            busy worker), and heartbeats of later steps show it progressing; only a lost Step record keeps it
            so that long (unitless, default 10: two read a 4-worker test run's 1 s lag as a stall).
    """

    stall_k: float = 2.0
    stall_floor_ns: int = 500_000_000
    heartbeat_interval_ns: int = 2_000_000_000
    silent_heartbeats: float = 3.0
    lost_step_bounds: float = 10.0

    def __post_init__(self) -> None:
        if not self.stall_k > 0 or self.stall_floor_ns < 0 or self.heartbeat_interval_ns <= 0 \
                or not self.silent_heartbeats > 0 or not self.lost_step_bounds > 0:
            raise ValueError(f"invalid hang parameters: {self}")

    def stall_bound_ns(self, median_step_ns: float) -> int:
        """``max(stall_k × median_step_ns, stall_floor_ns)``, ns (the floor alone without a median)."""
        m = median_step_ns if median_step_ns == median_step_ns and median_step_ns > 0 else 0.0
        return max(int(self.stall_k * m), self.stall_floor_ns)

    def silent_bound_ns(self, median_step_ns: float) -> int:
        """How long without any record makes a rank silent, ns."""
        return max(self.stall_bound_ns(median_step_ns), int(self.silent_heartbeats * self.heartbeat_interval_ns))


@dataclass(frozen=True)
class RankLiveness:
    """What one rank was last seen doing.

    Attributes:
        rank: global rank.
        last_seen_ns: event time of its newest record of any kind, ns since the Unix epoch.
        step: the last step it began (-1 if unknown).
        phase: the phase it was in ("" if none or unknown).
        collective: kind of the collective it was in (None if none), in ``group`` number ``group_index``
            (-1: its own group of that kind in the topology), ``seq`` its sequence number there (-1 unknown).
        in_flight_since_ns: when that collective was issued, ns since the epoch (-1 if none).
    """

    rank: int
    last_seen_ns: int
    step: int = -1
    phase: str = ""
    collective: PhaseKind | None = None
    group: ParallelGroup = ParallelGroup.NONE
    group_index: int = -1
    seq: int = -1
    in_flight_since_ns: int = -1

    @classmethod
    def from_heartbeat(cls, hb: Heartbeat, last_seen_ns: int | None = None) -> RankLiveness:
        """From a heartbeat (``last_seen_ns`` defaults to its time)."""
        return cls(hb.rank, hb.time_ns if last_seen_ns is None else last_seen_ns, hb.step, hb.phase,
                   hb.collective, hb.group, hb.group_index, hb.seq, hb.in_flight_since_ns)

    @property
    def waiting(self) -> bool:
        return self.collective is not None

    def state(self) -> dict[str, Any]:
        """Its evidence: step, phase, collective, group, seq."""
        return {"rank": self.rank, "step": self.step, "phase": self.phase,
                "collective": self.collective.value if self.collective else "", "group": self.group.value,
                "seq": self.seq}


@dataclass(frozen=True)
class HangResult:
    """One hang finding: ``ranks`` (named ranks: silent ones, or a group's suspects; empty for the job),
    ``steps`` (stable while the episode lasts), unitless ``score`` (time stalled over the stall bound, or
    silence over the silence bound), ``phase`` (the phase a group waits in), ``evidence`` (units in keys)."""

    kind: FindingKind
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    score: float
    phase: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def level(self) -> Level:
        return self.kind.level


def detect_hangs(ranks: Mapping[int, RankLiveness] | Iterable[RankLiveness], topology: JobTopology, now_ns: int,
                 last_progress_ns: int, last_completed_step: int, median_step_ns: float,
                 params: HangParams | None = None, silence_now_ns: int | None = None,
                 newest_ns: int | None = None, heard_since_ns: int | None = None) -> list[HangResult]:
    """Stall, silent ranks and the hang wavefront of a job at ``now_ns`` (see the module docstring).

    Args:
        ranks: each rank's liveness (ranks never seen are not judged: they may not have started).
        topology: the job's parallel groups.
        now_ns: event time of the judgement, ns since the epoch.
        last_progress_ns: when a rank last completed a step (or the job started), ns since the epoch.
        last_completed_step: the newest step any rank completed (-1 if none).
        median_step_ns: recent median step time, ns (NaN or 0 if unknown: the floor alone applies).
        silence_now_ns: the time silence is measured at (default ``now_ns``): the clock of the stream that
            carries every rank's records in one order (heartbeats), so ranks are never compared across
            topics read at different paces.
        newest_ns: the newest record read on that stream (default: the ranks' newest record): a rank is
            silent only by the bound older than it (other ranks still published after it went quiet).
        heard_since_ns: the first record read on that stream: a rank's silence there counts from it at the
            earliest (a rank whose first heartbeat is not read yet, while its steps are read behind, is not
            silent for the steps it was read behind).
    """
    p = params or HangParams()
    live = dict(ranks) if isinstance(ranks, Mapping) else {r.rank: r for r in ranks}
    if not live:
        return []
    bound, silent_bound = p.stall_bound_ns(median_step_ns), p.silent_bound_ns(median_step_ns)
    stalled_ns = now_ns - last_progress_ns
    quiet_now = now_ns if silence_now_ns is None else silence_now_ns
    # Silent *while other ranks still publish*: measured against the newest record of the job, not against now
    # alone. When the whole job goes quiet, its ranks' last records lie a little apart (and a busy worker reads
    # them unevenly): now passes the bound for some before the others, none of which is a silent rank.
    newest = max(s.last_seen_ns for s in live.values())
    if newest_ns is not None:
        newest = min(newest, newest_ns)  # records of other topics read ahead of it say nothing of silence
    all_silent = quiet_now - newest >= silent_bound
    # On that stream a rank is silent from its first record read there at the earliest: its older records,
    # read on other topics (maybe behind), say nothing of what that stream has carried since.
    seen = {r: max(s.last_seen_ns, heard_since_ns or 0) for r, s in live.items()}
    silent = sorted(r for r in live if newest - seen[r] >= silent_bound or all_silent)
    out: list[HangResult] = []
    if stalled_ns >= bound:
        out.append(HangResult(FindingKind.JOB_STALLED, (), (last_completed_step,), stalled_ns / bound, None, {
            "last_completed_step": last_completed_step, "seconds_stalled": stalled_ns / _NS,
            "stall_bound_s": bound / _NS, "all_ranks_silent": all_silent,
            "median_step_ms": median_step_ns / 1e6 if median_step_ns == median_step_ns else None}))
    if not all_silent:
        for r in silent:
            s = live[r]
            gap = quiet_now - seen[r]
            out.append(HangResult(FindingKind.RANK_SILENT, (r,), (s.step,), gap / silent_bound, s.phase or None, {
                "seconds_silent": gap / _NS, "silent_bound_s": silent_bound / _NS, "last_step": s.step,
                "last_phase": s.phase, "collective": s.collective.value if s.collective else "",
                "ranks_publishing": len(live) - len(silent)}))
    if stalled_ns >= bound:
        out += _wavefront(live, topology, set(silent), stalled_ns / _NS, stalled_ns / bound)
    return out


def job_resumed(stalled_since_ns: int, resumed_at_ns: int, step: int) -> HangResult:
    """The end of a stall episode that began at ``stalled_since_ns`` (the last progress before it) and ended
    at ``resumed_at_ns`` (the first completed step after it, at ``step``); times ns since the epoch."""
    duration = max(0, resumed_at_ns - stalled_since_ns)
    return HangResult(FindingKind.JOB_RESUMED, (), (step,), duration / _NS, None, {
        "seconds_stalled": duration / _NS, "resumed_step": step})


def _wavefront(live: dict[int, RankLiveness], topo: JobTopology, silent: set[int], seconds: float,
               score: float) -> list[HangResult]:
    index = {r: i for i, r in enumerate(topo.rank)}
    found: list[tuple[ParallelGroup, int, tuple[PhaseKind, int], list[int], list[int]]] = []
    for group, column in _GROUP_COLUMNS.items():
        members: dict[int, list[int]] = {}
        for r, i in index.items():
            members.setdefault(getattr(topo, column)[i], []).append(r)
        for gidx, ranks in sorted(members.items()):
            if len(ranks) < 2:
                continue
            waiting = [r for r in ranks if r in live and _in(live[r], group, gidx)]
            if not waiting:
                continue
            # The collective the group waits in: the one most of its waiting members are in (ties: the later).
            counts = Counter((live[r].collective, live[r].seq) for r in waiting)
            (kind, seq), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0][1]))
            assert kind is not None
            victims = sorted(r for r in waiting if (live[r].collective, live[r].seq) == (kind, seq))
            suspects = sorted(r for r in ranks if r not in victims)
            if suspects:
                found.append((group, gidx, (kind, seq), victims, suspects))
    if not found:
        return []
    victims_anywhere = {r for *_, v, _ in found for r in v}
    all_suspects = sorted({r for *_, s in found for r in s})
    # The head of the wavefront: suspects not waiting in any collective (in compute, or silent); else, in a
    # cycle of waits, those waiting the longest.
    first = [r for r in all_suspects if r in silent or r not in live or not live[r].waiting]
    if not first:
        oldest = min(live[r].in_flight_since_ns for r in all_suspects)
        first = [r for r in all_suspects if live[r].in_flight_since_ns == oldest]
    out = []
    for group, gidx, (kind, seq), victims, suspects in found:
        steps = [live[r].step for r in victims]
        step = statistics.median_low(steps)
        phases = Counter(live[r].phase for r in victims)
        phase = max(phases.items(), key=lambda kv: (kv[1], kv[0]))[0] or None
        out.append(HangResult(FindingKind.HANG_WAVEFRONT, tuple(suspects), (step,), score, phase, {
            "group": group.value, "group_index": gidx, "collective": kind.value, "seq": seq, "step": step,
            "phase": phase or "", "victims": victims, "suspects": suspects,
            "first_ranks": [r for r in first if r in suspects] or first,
            "first_of_wavefront": any(r in first for r in suspects),
            "suspects_also_waiting": sorted(r for r in suspects if r in victims_anywhere),
            "suspect_states": [live[r].state() | {"silent": r in silent} if r in live
                               else {"rank": r, "silent": True} for r in suspects],
            "seconds_stalled": seconds}))
    return out


def _in(s: RankLiveness, group: ParallelGroup, gidx: int) -> bool:
    """Whether ``s`` waits in a collective of ``group`` number ``gidx`` (-1 in the record: its own)."""
    return s.collective is not None and s.group is group and s.group_index in (-1, gidx)
