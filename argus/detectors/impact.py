"""Impact of a finding: the GPU time the whole job loses because of it, and whether that is worth raising.

A synchronous training job waits for its slowest member at every collective, so a delay of ``d`` ns per
step on the critical path (a straggler's extra compute, a degraded link's extra transfer, a regression's
extra iteration time) costs every rank ``d``: the job loses ``d * world_size`` GPU-ns per affected step
(:attr:`Impact.gpu_ns_per_step`) and that times the affected steps in total (:attr:`Impact.gpu_ns`). A
finding whose delay is under ``min_fraction`` of the job's median step time (default 1 %) is noise to a
user, whatever its statistical strength: :func:`worth_raising` says so.

The delay per step comes from the detectors: L1 and L2 results carry ``delay_ns_per_step`` and
``steps_affected``; an L3 result carries ``excess_ns`` over the judged window, spread over the steps that
began in it (:meth:`StepClock.steps_in`) -- from the onset on where its rank slowed down inside the window
(:attr:`StepClock.onsets`, :mod:`argus.detectors.onsets`): a late onset's excess is the affected steps' only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from argus.detectors.l1_iteration import L1Result
from argus.detectors.l2_phases import L2Result
from argus.detectors.l3_kernels import L3Result

__all__ = ["Impact", "StepClock", "impact_of", "worth_raising"]


@dataclass(frozen=True)
class StepClock:
    """What the diagnosis knows of a job's steps: their start times (ns since the epoch, ascending), the
    median iteration time (ns; 0 when unknown), ``onsets``: (rank, start ns of its onset step) of the ranks
    that slowed down part way through the steps (:func:`~argus.detectors.onsets.rank_onsets`), by rank, and
    the ranks' routed tokens (:mod:`argus.detectors.experts`)."""

    starts_ns: tuple[int, ...] = ()
    median_step_ns: float = 0.0
    onsets: tuple[tuple[int, int], ...] = ()
    #: (rank, tokens routed to its MoE experts over the complete steps) of the ranks that counted them in every
    #: complete step (``Step.expert_tokens``), by rank; empty when not counted.
    expert_tokens: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, starts_ns: Sequence[int], step_ns: Sequence[float]) -> StepClock:
        """From the complete steps' starts and iteration times (any order)."""
        times = sorted(float(t) for t in step_ns)
        n = len(times)
        median = 0.0 if n == 0 else (times[(n - 1) // 2] + times[n // 2]) / 2.0
        return cls(tuple(sorted(int(s) for s in starts_ns)), median)

    def steps_in(self, start_ns: int, end_ns: int) -> int:
        """Steps that began in ``[start_ns, end_ns)``; at least 1 (a window holds part of a step at least)."""
        lo = bisect.bisect_left(self.starts_ns, start_ns)
        hi = bisect.bisect_left(self.starts_ns, end_ns)
        return max(hi - lo, 1)

    def affected_steps(self, ranks: Sequence[int], start_ns: int, end_ns: int, share: float = 1.0) -> int:
        """Steps of ``[start_ns, end_ns)`` an excess of ``ranks`` was spent in: from the earliest onset among them
        where every one has an onset inside the span (:attr:`onsets`), else ``share`` of the steps that began
        in it (the share of its calls the slowdown moved, :mod:`argus.detectors.call_modes`; at least one)."""
        every = self.steps_in(start_ns, end_ns)
        onset = dict(self.onsets)
        at = [onset.get(r) for r in ranks]
        first = None if not at or None in at else min(a for a in at if a is not None)
        if first is None or not start_ns < first < end_ns:
            return max(round(every * min(max(share, 0.0), 1.0)), 1)
        return self.steps_in(first, end_ns)


@dataclass(frozen=True)
class Impact:
    """``delay_ns_per_step``: critical-path delay per affected step; ``steps``: affected steps;
    ``gpu_ns_per_step`` and ``gpu_ns``: GPU time the job lost per step and in total (ns)."""

    delay_ns_per_step: float
    steps: int
    gpu_ns_per_step: float
    gpu_ns: float

    def step_fraction(self, clock: StepClock) -> float | None:
        """The delay as a fraction of the median step time (None when that is unknown)."""
        return self.delay_ns_per_step / clock.median_step_ns if clock.median_step_ns > 0 else None


def impact_of(result: L1Result | L2Result | L3Result, world_size: int, window_steps: int = 1) -> Impact:
    """The impact of one detector result in a job of ``world_size`` ranks; ``window_steps``: for an L3
    result, the steps that began in its window (:meth:`StepClock.steps_in`)."""
    if isinstance(result, L3Result):
        steps = max(window_steps, 1)
        delay = max(result.excess_ns, 0.0) / steps
    else:
        steps = max(result.steps_affected, 1)
        delay = max(result.delay_ns_per_step, 0.0)
    per_step = delay * max(world_size, 1)
    return Impact(delay, steps, per_step, per_step * steps)


def worth_raising(impact: Impact, clock: StepClock, min_fraction: float) -> bool:
    """Whether the delay is at least ``min_fraction`` of the median step time; True when the step time is
    unknown (nothing to judge by: the detectors' own gates stand)."""
    fraction = impact.step_fraction(clock)
    return fraction is None or fraction >= min_fraction
