"""Per-job diagnosis state of the stream agents: what to feed L1/L2/L3 and when (pure, no Kafka).

:class:`JobDiagnosis` (L1 + L2) gathers a job's Step and PhaseBatch records, its topology and its END.
A step is *complete* once every rank reported its Step and PhaseBatch; every ``detect_every`` complete
steps the detectors run on what is complete (live), and once more when the END's record counts have all
arrived (final). :class:`KernelDiagnosis` (L3) gathers the KernelSummary rows of one (job, kernel, stream)
and judges each event-time window once it is complete (see :class:`KernelDiagnosis`) and every remaining
window at the job's end.

Findings carry deterministic ids, so repeated runs over growing data emit each finding once; a regression
whose onset estimate moves by less than ``L1Params.min_segment`` steps counts as the same finding.

Details and reasoning: docs/internals/streams.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

import numpy as np

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.core.settings import Settings
from argus.detectors.call_modes import ModeParams
from argus.detectors.experts import hot_experts, repeated_expert
from argus.detectors.findings import DetectorResult, to_finding
from argus.detectors.hosts import HostParams, detect_host_excess
from argus.detectors.impact import StepClock, impact_of, worth_raising
from argus.detectors.incidents import IncidentParams
from argus.detectors.kernel_excess import detect_kernel_excess
from argus.detectors.l1_iteration import IterationSeries, L1Params, L1Result, detect_l1
from argus.detectors.l2_history import PhaseHistory
from argus.detectors.l2_phases import L2Params, L2Result
from argus.detectors.l3_kernels import L3Params, L3Result, detect_l3
from argus.detectors.l3_ranks import KernelTotals, RankExcessParams, detect_rank_excess, detect_stage_excess
from argus.detectors.link_ledger import LinkLedger
from argus.detectors.links import CORROBORATES_ONLY, IMPACT_BAR_SHARE, corroborates_only
from argus.detectors.onsets import OnsetParams, rank_onsets
from argus.schemas.records import Finding, JobLifecycle, JobTopology, KernelSummary, ParallelGroup, PhaseBatch, Step

__all__ = ["CORROBORATES_ONLY", "DiagnosisParams", "JobDiagnosis", "JudgedWindow", "KernelDiagnosis", "LinkLedger",
           "RankDiagnosis", "corroborates_only", "detector_version", "judge"]

#: Layouts (the tuple objects of a batch's streams, kinds and groups) a JobDiagnosis remembers having learnt
#: collective groups from; past this many it starts again (learning again is only slower, never different).
_LEARNT_KEPT = 256
_GPU_NS, _WALL_NS, _START_NS = attrgetter("gpu_ns"), attrgetter("wall_ns"), attrgetter("start_ns")
_TOKENS = attrgetter("expert_tokens")
#: L2 kinds naming ranks slow in their own compute phases.
_RANK_PHASE_KINDS = frozenset({FindingKind.COMPUTE_STRAGGLER, FindingKind.PHASE_STRAGGLER})
#: The span of a job-wide judgement (every step): before and after any epoch time.
_NO_START, _NO_END = -(1 << 62), 1 << 62


@dataclass(frozen=True)
class DiagnosisParams:
    """When and on how much data the detectors run."""

    #: Run L1/L2 every this many newly complete steps (live detection latency, in steps).
    detect_every: int = 5
    #: Complete steps of phase records kept for L2 (older ones are dropped: bounded memory).
    history_steps: int = 200
    #: Least delay a finding adds per step, as a fraction of the median step time, to be raised (1 %).
    min_impact_fraction: float = 0.01
    #: An L3 window judged live raises findings at this multiple of ``min_impact_fraction``; at the job's
    #: end every window is judged again at 1x (see :class:`KernelDiagnosis`).
    live_impact_margin: float = 1.5
    l1: L1Params = field(default_factory=L1Params)
    l2: L2Params = field(default_factory=L2Params)
    l3: L3Params = field(default_factory=L3Params)
    ranks: RankExcessParams = field(default_factory=RankExcessParams)
    #: When findings form one incident (a slow host: docs/incidents.md).
    incidents: IncidentParams = field(default_factory=IncidentParams)
    onsets: OnsetParams = field(default_factory=OnsetParams)
    #: How the calls a slowdown moved out of a kernel's duration modes give the share of the steps it was spent
    #: in (:mod:`argus.detectors.call_modes`).
    modes: ModeParams = field(default_factory=ModeParams)
    #: When a host's ranks are slow together (:func:`~argus.detectors.hosts.detect_host_excess`).
    hosts: HostParams = field(default_factory=HostParams)
    #: A rank routed at least this multiple of its expert-parallel group's median tokens is a hot expert's:
    #: its longer phases are routing, not a fault (:func:`~argus.detectors.experts.hot_experts`).
    hot_expert_tokens_ratio: float = 1.1
    #: Complete steps a live run needs before it names a compute straggler by its lateness alone (no elevated
    #: phase of its own): a few GPUs a few percent apart by nature arrive last over five steps, which the next
    #: cuts do not confirm. The job's last run judges every step it has, however few.
    late_only_min_steps: int = 10

    def __post_init__(self) -> None:
        if self.detect_every < 1 or self.history_steps < 1 or self.late_only_min_steps < 1:
            raise DetectorError(f"detect_every, history_steps and late_only_min_steps must be >= 1, got "
                                f"{self.detect_every}, {self.history_steps}, {self.late_only_min_steps}")
        if not (0.0 <= self.min_impact_fraction < 1.0 and self.live_impact_margin >= 1.0):
            raise DetectorError(f"need 0 <= min_impact_fraction < 1 and live_impact_margin >= 1, got "
                                f"{self.min_impact_fraction}, {self.live_impact_margin}")
        if not (math.isfinite(self.hot_expert_tokens_ratio) and self.hot_expert_tokens_ratio > 1.0):
            raise DetectorError(f"hot_expert_tokens_ratio must be finite and > 1, got {self.hot_expert_tokens_ratio}")


#: Settings that change what the compressor and the detectors find (they enter :func:`detector_version`).
_DETECTOR_SETTINGS = ("window_ns", "allowed_lateness_ns", "max_event_skew_ns", "max_kernel_names", "l3_max_windows",
                      "kde_grid_points", "kde_min_samples", "kde_min_log_gap", "min_impact_fraction")
#: The code that decides findings: every detector, and the windowing, compression and judging around them.
_DETECTOR_CODE = ("detectors", "streams/windows.py", "streams/compression.py", "streams/diagnosis.py")


def detector_version(params: DiagnosisParams, settings: Settings) -> str:
    """``<package version>+<12 hex digits>``: the detectors that make a finding, stamped on it.

    The hex digits are a SHA-256 of the detector parameters (``params`` and the settings that shape windows,
    compression and the impact threshold) and of the detectors' source code, so a replay whose detectors or
    parameters differ from the live run's is told apart from it, and one with the same detectors is not.
    """
    knobs = {"params": dataclasses.asdict(params), "settings": {n: getattr(settings, n) for n in _DETECTOR_SETTINGS}}
    digest = hashlib.sha256(json.dumps(knobs, sort_keys=True, default=str).encode())
    digest.update(_code_digest())
    return f"{_package_version()}+{digest.hexdigest()[:12]}"


@functools.cache
def _code_digest() -> bytes:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for entry in _DETECTOR_CODE:
        path = root / entry
        for src in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(src.relative_to(root).as_posix().encode() + b"\0" + src.read_bytes() + b"\0")
    return h.digest()


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("argus-failslow")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def judge(job_id: str, results: list[DetectorResult], time_ns: int, world_size: int, clock: StepClock,
          min_fraction: float, window: tuple[int, int] | None = None) -> list[Finding]:
    """The findings of ``results`` worth raising (:func:`~argus.detectors.impact.worth_raising`), each with its
    impact; ``window``: the judged window of L3 results (its steps spread their excess, from the onset on
    where the named ranks slowed down inside it: :meth:`~argus.detectors.impact.StepClock.affected_steps`)."""
    steps = clock.steps_in(*window) if window is not None else max(len(clock.starts_ns), 1)
    span = window if window is not None else (_NO_START, _NO_END)
    out = []
    for res in results:
        impact = impact_of(res, world_size, clock.affected_steps(res.ranks, *span, res.affected_share)
                           if isinstance(res, L3Result) else steps)
        link = isinstance(res, L3Result) and res.kind is FindingKind.LINK_DEGRADED
        worth = worth_raising(impact, clock, min_fraction)
        if worth and not (link and res.evidence.get(CORROBORATES_ONLY)):
            out.append(to_finding(job_id, res, time_ns, impact))
        elif link:
            # A degraded link slows every collective its group runs, the small ones too: too little to raise
            # alone (or too weak to name it), such a result still corroborates the group's other
            # collectives, and its delay counts towards the group's (see LinkLedger).
            share = (impact.step_fraction(clock) or 0.0) / min_fraction if min_fraction > 0 else 0.0
            weak = dataclasses.replace(res, evidence=res.evidence | {CORROBORATES_ONLY: True,
                                                                     IMPACT_BAR_SHARE: share})
            out.append(to_finding(job_id, weak, time_ns, impact))
    return out


def _most_gpu_ns(steps: Iterable[Step]) -> float:
    """The largest GPU time of ``steps`` (ns), NaN where none has one."""
    gpu = list(map(_GPU_NS, steps))
    try:
        return float(max(gpu))  # one C-level pass where every rank sent its GPU time (the usual case)
    except (TypeError, ValueError):  # a None among them, or no step at all
        known = [g for g in gpu if g is not None]
        return float(max(known)) if known else math.nan


class JobDiagnosis:
    """L1 and L2 state of one job.

    A complete step's phase batches are folded once into the job's :class:`PhaseHistory` (compact per-step
    columns; the last ``history_steps`` complete steps are kept) and dropped; a batch of a held step
    delivered again replaces its rank's phases there (the last batch wins), one of a step no longer held
    is ignored. ``diagnose`` runs L2 over the history: the findings ``detect_l2`` gives over a table built
    from the held steps' batches."""

    def __init__(self, job_id: str, params: DiagnosisParams | None = None) -> None:
        self.job_id = job_id
        self.params = params or DiagnosisParams()
        self.topology: JobTopology | None = None
        self.world_size: int | None = None
        self.end: JobLifecycle | None = None
        self.steps_seen = 0
        self.phases_seen = 0
        self._steps: dict[int, dict[int, Step]] = {}
        self._phases: dict[int, dict[int, PhaseBatch]] = {}  # steps not complete yet
        self._history = PhaseHistory(self.params.history_steps)
        self._last_layout: PhaseBatch | None = None
        # The (streams, kinds, groups) objects learnt from (by id; learning from equal ones again adds nothing).
        self._learnt: dict[tuple[int, int, int], tuple[object, ...]] = {}
        self._complete: list[int] = []
        self._done: set[int] = set()
        # The job's iteration series, one entry per complete step: max over ranks (the job waits for all).
        self._series: list[tuple[int, float, float]] = []
        self._starts: list[int] = []
        self._last_run = 0
        self._l1_cut = 0  # complete steps L1 last read
        self._emitted: set[str] = set()
        self._onsets: list[int] = []
        self._onset_cache: tuple[int, tuple[tuple[int, int], ...]] | None = None
        #: Per rank: tokens routed to its experts over the complete steps, and the steps that counted them.
        self._tokens: dict[int, tuple[int, int]] = {}
        self.last_time_ns = 0
        #: The parallel group each collective stream serves, learnt from the phases (for L3).
        self.collective_groups: dict[int, ParallelGroup] = {}

    def add(self, record: Step | PhaseBatch | JobTopology | JobLifecycle) -> None:
        """Take one record of the job (any order)."""
        # Every rank sends a Step and a PhaseBatch each step (20,480 calls a step at 10,240 ranks): those two
        # take the shortest path, with no call beyond this one unless the record completes its step.
        kind = type(record)
        if kind is PhaseBatch or (kind is not Step and isinstance(record, PhaseBatch)):
            batch: PhaseBatch = record  # type: ignore[assignment]
            self.phases_seen += 1
            last = self._last_layout
            # A batch of streams, kinds and groups already learnt from teaches nothing new (most batches: those of
            # one producer, and decoded ones of one layout, hold the very same tuples).
            if last is None or not (batch.streams is last.streams and batch.kinds is last.kinds
                                    and batch.groups is last.groups):
                self._learn_groups(batch)
            step = batch.step
            if step in self._done:
                if self._history.holds(step):
                    self._history.replace(batch)
                return
            phases = self._phases.get(step)
            if phases is None:
                phases = self._phases[step] = {}
            phases[batch.rank] = batch
            n = self.world_size
            if n is not None and len(phases) >= n and len(self._steps.get(step, ())) >= n:
                self._complete_step(step)
        elif isinstance(record, Step):
            self.steps_seen += 1
            step = record.step
            ranks = self._steps.get(step)
            if ranks is None:
                ranks = self._steps[step] = {}
            ranks[record.rank] = record
            end = record.start_ns + record.wall_ns
            if end > self.last_time_ns:
                self.last_time_ns = end
            n = self.world_size
            # _maybe_complete's test, inline: a call per Step record costs more than the test.
            if n is not None and len(ranks) >= n and len(self._phases.get(step, ())) >= n and step not in self._done:
                self._complete_step(step)
        elif isinstance(record, JobTopology):
            self.topology = record
            self.world_size = record.world_size
            for stream, group in record.stream_groups().items():  # the topology's word beats a phase's guess
                if group is not ParallelGroup.NONE:
                    self.collective_groups[stream] = group
            for step in sorted(self._steps):
                self._maybe_complete(step)
        elif isinstance(record, JobLifecycle):
            self.world_size = self.world_size or record.world_size
            if record.event.value == "END":
                self.end = record

    def _learn_groups(self, record: PhaseBatch) -> None:
        """The groups of collective streams ``record`` names first (the topology's, when known, stay)."""
        self._last_layout = record
        key = (id(record.streams), id(record.kinds), id(record.groups))
        if key in self._learnt:
            return
        for kind, group, stream in zip(record.kinds, record.groups, record.streams, strict=True):
            if group is not ParallelGroup.NONE and stream >= 0 and stream not in self.collective_groups \
                    and kind.is_collective:
                self.collective_groups[stream] = group
        if len(self._learnt) >= _LEARNT_KEPT:
            self._learnt.clear()
        # The tuples are held with their ids: no id is reused while it is a key.
        self._learnt[key] = (record.streams, record.kinds, record.groups)

    @property
    def complete_steps(self) -> int:
        return len(self._complete)

    def clock(self) -> StepClock:
        """The complete steps' starts and median iteration time, and the onsets of ranks that slowed down part
        way through the held steps (:func:`~argus.detectors.onsets.rank_onsets`), for judging impacts."""
        clock = StepClock.of(self._starts, [wall for _, wall, _ in self._series])
        if not self._series:
            return clock
        n = len(self._series)
        tokens = tuple((r, tok) for r, (tok, steps) in sorted(self._tokens.items()) if steps == n)
        return dataclasses.replace(clock, onsets=self._rank_onsets(), expert_tokens=tokens)

    def _rank_onsets(self) -> tuple[tuple[int, int], ...]:
        """(rank, start ns of its onset step), computed again every ``detect_every`` complete steps (the live
        cadence: clock() is asked often, and at 10,240 ranks a pass over the history costs ~0.1 s) and once the
        job has finished."""
        held, n = self._onset_cache, len(self._complete)
        if held is not None and (held[0] == n or (n - held[0] < self.params.detect_every and not self.finished())):
            return held[1]
        first: dict[int, int] = {}
        # Its compute phases, and its collective phases: a degraded link slows its members' collectives (not
        # their compute) from its onset on, while a rank slow in its own work arrives later and waits less.
        for collective in (False, True):
            steps, ranks, phases, own = self._history.compute_own(self.params.onsets.max_steps, collective)
            at = rank_onsets(own, phases, self.params.onsets) if ranks.size else np.empty(0, np.int64)
            for r, i in zip(ranks.tolist(), at.tolist(), strict=True):
                if i >= 0:  # a rank's earliest onset over its phases
                    first[r] = min(first.get(r, steps[i]), steps[i])
        start = dict(zip((s for s, _, _ in self._series), self._starts, strict=True))
        found = tuple((r, start[step]) for r, step in sorted(first.items()) if step in start)
        self._onset_cache = (len(self._complete), found)
        return found

    def due(self) -> bool:
        """Enough new complete steps since the last live run."""
        return self.complete_steps - self._last_run >= self.params.detect_every

    def finished(self) -> bool:
        """The END arrived and so did every Step and PhaseBatch it announced (unknown counts: END alone)."""
        if self.end is None:
            return False
        return ((self.end.steps is None or self.steps_seen >= self.end.steps)
                and (self.end.phase_batches is None or self.phases_seen >= self.end.phase_batches))

    def kernels_traced(self) -> bool:
        """Whether the job's END says it traced kernel events (then the kernels judge its pipeline stages)."""
        return self.end is not None and (self.end.kernel_events or 0) > 0

    def diagnose(self, final: bool = False) -> list[Finding]:
        """Run L1 and L2 on the complete steps; returns the findings not emitted before. ``final``: the job's
        last run (it finished, or is closed without its END).

        A phase-level slow pipeline stage is raised only by the final run of a job that traced no kernels: a
        stage's phase times also hold its schedule's waiting and its own share of the model (embedding, output
        layer, loss), which no phase comparison tells from a slow stage, and where kernels are traced the
        stages' common kernels judge it (:func:`~argus.detectors.l3_ranks.detect_stage_excess`)."""
        self._last_run = self.complete_steps
        results: list[L1Result | L2Result] = []
        onset = None
        # L1 reads the first k * detect_every complete steps for every k reached since its last run (and all of
        # them at the job's end): a finding is first judged on the same steps however the steps arrived (one
        # at a time live, in bursts under load or in a replay), so it carries the same evidence.
        for cut in self._l1_cuts():
            part = sorted(self._series[:cut])
            series = IterationSeries.from_arrays(*map(np.array, zip(*part, strict=True)))
            onset = None
            for r in detect_l1(series, params=self.params.l1):
                if r.kind is FindingKind.STEP_REGRESSION:
                    step = r.steps[0]
                    onset = step if onset is None else onset
                    if any(abs(step - o) < self.params.l1.min_segment for o in self._onsets):
                        continue
                    self._onsets.append(step)
                results.append(r)
        if self.topology is not None and self._complete:
            l2 = self._history.detect(self.topology, self.params.l2, onset_step=onset)
            # A popular MoE expert's rank runs longer phases in the expert groups routing to it, and where tokens are
            # counted a hot expert's rank is known by them: routing, not a fault (its speed per token is judged
            # on its grouped GEMMs).
            named = {r for res in l2 if res.kind in _RANK_PHASE_KINDS for r in res.ranks}
            tokens = {r: tok for r, (tok, steps) in self._tokens.items() if steps == len(self._series)}
            routed = repeated_expert(named, self.topology) | hot_experts(
                named, self.topology, tokens, self.params.hot_expert_tokens_ratio)
            early = not final and self.complete_steps < self.params.late_only_min_steps
            results.extend(res for res in l2 if not (res.kind in _RANK_PHASE_KINDS and routed.issuperset(res.ranks))
                           and (res.kind is not FindingKind.PP_STAGE_SLOW or (final and not self.kernels_traced()))
                           and not (early and res.evidence.get("late_arrival_only") is True))
        new = []
        world = self.world_size or (len(self.topology.rank) if self.topology else 1)
        for finding in judge(self.job_id, list(results), self.last_time_ns, world, self.clock(),
                             self.params.min_impact_fraction):
            if finding.finding_id not in self._emitted:
                self._emitted.add(finding.finding_id)
                new.append(finding)
        return new

    def _l1_cuts(self) -> list[int]:
        """The numbers of complete steps L1 reads this run (see :meth:`diagnose`)."""
        n, every = len(self._series), self.params.detect_every
        cuts = list(range(self._l1_cut - self._l1_cut % every + every, n + 1, every))
        if n and (not cuts or (self.finished() and cuts[-1] != n)):
            cuts.append(n)
        self._l1_cut = max(self._l1_cut, n if not cuts else cuts[-1])
        return cuts

    def _maybe_complete(self, step: int) -> None:
        n = self.world_size
        if n is not None and step not in self._done and len(self._steps.get(step, ())) >= n \
                and len(self._phases.get(step, ())) >= n:
            self._complete_step(step)

    def _complete_step(self, step: int) -> None:
        self._done.add(step)
        bisect.insort(self._complete, step)
        ranks = self._steps.pop(step).values()
        counted = list(map(_TOKENS, ranks))
        if counted.count(None) != len(counted):  # one C-level pass where no rank counts tokens (most jobs)
            for st, tokens in zip(ranks, counted, strict=True):
                if tokens is not None:
                    tok, n = self._tokens.get(st.rank, (0, 0))
                    self._tokens[st.rank] = (tok + tokens, n + 1)
        self._series.append((step, float(max(map(_WALL_NS, ranks))), _most_gpu_ns(ranks)))
        self._starts.append(min(map(_START_NS, ranks)))
        batches = self._phases.pop(step)
        held = self.params.history_steps
        if 0 < held < len(self._complete):
            # The one step this one may push out of the history (the older ones were dropped before).
            self._history.drop(self._complete[-held - 1])
        if step in self._complete[-held:]:
            self._history.fold(step, list(batches.values()), batches.keys())

    def phase_state_bytes(self) -> int:
        """Bytes of the folded phase history held (the arrays; see :class:`PhaseHistory`)."""
        return self._history.state_bytes()


@dataclass(frozen=True)
class JudgedWindow:
    """What L3 found in one window of a (job, kernel, stream): its end (ns), the topology and group kind it was
    read under, and the detector results (before their impact is judged)."""

    end_ns: int
    topology: JobTopology | None
    group_kind: ParallelGroup | None
    results: tuple[DetectorResult, ...]

    def holds(self, topology: JobTopology | None, group_kind: ParallelGroup | None) -> bool:
        """Whether these results are what L3 would find under ``topology`` and ``group_kind``."""
        return self.group_kind == group_kind and (self.topology is topology or self.topology == topology)


class KernelDiagnosis:
    """L3 state of one (job, kernel, stream): summary rows by window.

    Compressors of different partitions progress at different speeds, and an import sends one rank after
    another, so a window may be missing ranks long after the next one began. A window is judged live once
    it is complete: every rank of the pipeline stages this key was seen on has it (the topology says which:
    a stage's ranks run the same kernels). A partial window would compare the ranks that happen to be there
    (ranks of one TP index alone look like a slow group). At the job's end every window is judged again,
    against the job's final step time: live, only findings clear of the impact bar by
    ``DiagnosisParams.live_impact_margin`` are raised, so what is raised does not depend on when a window
    completed.

    Each judged window's detector results are kept (:class:`JudgedWindow`, a few results at most): the judgement
    at the job's end re-reads them against the final step time instead of running L3 again on rows that did
    not change (nor under another topology or group), so a subclass may drop the rows of judged windows
    (:class:`~argus.streams.summary_pieces.BoundedKernelDiagnosis`) and the end still judges every window.
    """

    def __init__(self, job_id: str, kernel: str, stream: int, params: DiagnosisParams | None = None) -> None:
        self.job_id, self.kernel, self.stream = job_id, kernel, stream
        self.params = params or DiagnosisParams()
        self._windows: dict[int, list[KernelSummary]] = defaultdict(list)
        self._ranks: dict[int, set[int]] = defaultdict(set)
        self._seen_ranks: set[int] = set()
        self._judged: dict[int, int] = {}  # window start -> number of ranks when judged
        self._final_judged: dict[int, int] = {}  # the same, for the judgements at the job's end
        self._results: dict[int, JudgedWindow] = {}  # window start -> its last judgement's results
        self._expected_for: tuple[tuple[int, int], set[int]] = ((0, -1), set())
        self._emitted: set[str] = set()

    def add(self, summary: KernelSummary) -> None:
        for i, ws in enumerate(summary.window_start_ns):
            self._windows[ws].append(_row(summary, i))
            self._ranks[ws].add(summary.rank[i])
            self._seen_ranks.add(summary.rank[i])
            self._results.pop(ws, None)  # its rows changed

    def _expected(self, topology: JobTopology) -> set[int]:
        """The ranks of every pipeline stage this key was seen on (all ranks when the seen ones are unknown
        to the topology)."""
        key = (id(topology), len(self._seen_ranks))
        if self._expected_for[0] != key:  # recomputed only when the topology or the seen ranks change
            stage_of = dict(zip(topology.rank, topology.pp_stage, strict=True))
            if not self._seen_ranks <= stage_of.keys():
                ranks = set(topology.rank)
            else:
                stages = {stage_of[r] for r in self._seen_ranks}
                ranks = {r for r, st in stage_of.items() if st in stages}
            self._expected_for = (key, ranks)
        return self._expected_for[1]

    def diagnose(self, topology: JobTopology | None, final: bool = False,
                 group_kind: ParallelGroup | None = None, clock: StepClock | None = None) -> list[Finding]:
        """Judge the windows that are complete (see the class docstring) and not judged with these ranks.

        Live judgements wait for the job's topology (groups decide how collectives are read) and its steps
        (``clock``: impacts are judged against the step time); at the end whatever is known is used.
        ``group_kind``: the group this stream's collectives run in, if known.
        """
        if (topology is None or clock is None or clock.median_step_ns <= 0) and not final:
            return []
        clock = clock or StepClock()
        world = topology.world_size if topology is not None else len(self._seen_ranks)
        expected = self._expected(topology) if topology is not None else self._seen_ranks
        ready: list[tuple[int, int]] = []
        # At the end, windows whose rows were dropped after their judgement are judged again from their results.
        for ws in sorted(self._windows.keys() | self._results.keys()) if final else sorted(self._windows):
            # A window whose rows were dropped keeps the number of ranks it was judged with.
            n = len(self._ranks[ws]) if ws in self._windows else self._judged[ws]
            if (self._final_judged if final else self._judged).get(ws) == n:
                continue
            # Live, the window's steps must be known too (a step began after it): its impact spreads its excess
            # over them, and a restarted worker may see summaries before the steps they belong to.
            if final or (self._ranks[ws] >= expected and bool(clock.starts_ns)
                         and clock.starts_ns[-1] >= self._windows[ws][0].window_end_ns[0]):
                ready.append((ws, n))
        # A live judgement reads the step time known so far, which depends on when the window completed: only
        # findings clear of the impact bar by a margin are raised live, the rest when every window is judged
        # again against the job's final steps. So the same records give the same findings, however they came.
        fraction = self.params.min_impact_fraction * (1.0 if final else self.params.live_impact_margin)
        new: list[Finding] = []
        for ws, n in ready:
            kept = self._results.get(ws)
            if kept is None or (ws in self._windows and not kept.holds(topology, group_kind)):
                rows = self._windows[ws]
                kept = self._results[ws] = JudgedWindow(rows[0].window_end_ns[0], topology, group_kind,
                                                        tuple(detect_l3(rows, topology, self.params.l3, group_kind)))
            self._judged[ws] = n
            if final:
                self._final_judged[ws] = n
            for finding in judge(self.job_id, list(kept.results), kept.end_ns, world, clock, fraction,
                                 (ws, kept.end_ns)):
                if corroborates_only(finding):
                    new.append(finding)
                elif finding.finding_id not in self._emitted:
                    self._emitted.add(finding.finding_id)
                    new.append(finding)
        return new


class RankDiagnosis:
    """Job-level L3 state: every compute kernel's time and calls per rank (:class:`KernelTotals`), judged
    once at the job's end by :func:`~argus.detectors.l3_ranks.detect_rank_excess` (ranks slow across
    kernels), :func:`~argus.detectors.kernel_excess.detect_kernel_excess` (kernels slower than their rank's
    speed predicts) and, with a topology, :func:`~argus.detectors.l3_ranks.detect_stage_excess`."""

    def __init__(self, job_id: str, params: DiagnosisParams | None = None) -> None:
        self.job_id = job_id
        self.params = params or DiagnosisParams()
        self._totals: dict[tuple[str, int], KernelTotals] = {}
        self._ranks: set[int] = set()
        self.last_time_ns = 0

    def add(self, summary: KernelSummary) -> None:
        key = (summary.kernel, summary.stream)
        totals = self._totals.get(key)
        if totals is None:
            totals = self._totals[key] = KernelTotals(summary.kernel, summary.stream, mode_params=self.params.modes)
        totals.add(summary)
        self._ranks.update(summary.rank)
        self.last_time_ns = max(self.last_time_ns, *summary.window_end_ns, 0)

    def totals(self) -> list[KernelTotals]:
        """Its per-rank kernel totals (one L3 part's, shared with the part that judges the job)."""
        return list(self._totals.values())

    def add_totals(self, totals: Iterable[KernelTotals], last_time_ns: int) -> None:
        """Add another part's per-rank kernel totals (sums per rank and kernel)."""
        for t in totals:
            mine = self._totals.get((t.kernel, t.stream))
            if mine is None:
                mine = self._totals[(t.kernel, t.stream)] = KernelTotals(t.kernel, t.stream,
                                                                         mode_params=self.params.modes)
            mine.merge(t)
            self._ranks.update(t.total_ns)
        self.last_time_ns = max(self.last_time_ns, last_time_ns)

    def diagnose(self, topology: JobTopology | None, clock: StepClock | None = None) -> list[Finding]:
        """The ranks slow across kernels, with their impact over the job's steps; every rank of a pipeline stage
        slow alike is the stage (:attr:`~argus.core.kinds.FindingKind.PP_STAGE_SLOW`) where the stage check
        finds it."""
        world = topology.world_size if topology is not None else len(self._ranks)
        slow = detect_rank_excess(self._totals.values(), topology, self.params.ranks)
        named = {r for res in slow for r in res.ranks}
        # A host's GPUs slow together, each under the per-rank gates (a power cap, a late onset).
        slow += detect_host_excess(self._totals.values(), topology, self.params.hosts, exclude=named)
        results: list[DetectorResult] = list(slow)
        named = {r for res in slow for r in res.ranks}
        tokens = dict(clock.expert_tokens) if clock is not None else None
        results += detect_kernel_excess(self._totals.values(), topology, self.params.ranks, exclude=named,
                                        expert_tokens=tokens)
        if topology is not None:
            steps = max(len(clock.starts_ns), 1) if clock is not None else 1
            # Every rank of a stage slow alike is the stage's slowness (its work or its hosts), not stragglers
            # of their own: such ranks stay in the stage comparison, and a slow stage found explains them.
            whole = _whole_stages(topology, named)
            stages = detect_stage_excess(self._totals.values(), topology, self.params.ranks,
                                         exclude=named - whole)
            explained = {r for res in stages for r in res.ranks} & whole
            results = [r for r in results if isinstance(r, L1Result) or not explained.issuperset(r.ranks)]
            results += [dataclasses.replace(r, delay_ns_per_step=r.evidence["stage_delay_ms"] * 1e6 / steps,
                                            steps_affected=steps) for r in stages]
        return judge(self.job_id, results, self.last_time_ns, world, clock or StepClock(),
                     self.params.min_impact_fraction)


def _whole_stages(topology: JobTopology, ranks: set[int]) -> set[int]:
    """The ranks of ``ranks`` that make up whole pipeline stages of two or more ranks."""
    members: dict[int, set[int]] = defaultdict(set)
    for r, st in zip(topology.rank, topology.pp_stage, strict=True):
        members[st].add(r)
    if len(members) < 2:
        return set()
    return {r for m in members.values() if len(m) >= 2 and m <= ranks for r in m}


def _row(s: KernelSummary, i: int) -> KernelSummary:
    """Row ``i`` of a multi-row summary as a one-row summary."""
    start = sum(s.n_clusters[:i])
    sl = slice(start, start + s.n_clusters[i])
    return KernelSummary(
        job_id=s.job_id, kernel=s.kernel, stream=s.stream, rank=(s.rank[i],),
        window_start_ns=(s.window_start_ns[i],), window_end_ns=(s.window_end_ns[i],), n_events=(s.n_events[i],),
        n_clusters=(s.n_clusters[i],), cluster_count=s.cluster_count[sl], cluster_p50_ns=s.cluster_p50_ns[sl],
        cluster_p99_ns=s.cluster_p99_ns[sl], cluster_min_ns=s.cluster_min_ns[sl],
        cluster_max_ns=s.cluster_max_ns[sl], cluster_sum_ns=s.cluster_sum_ns[sl],
    )
