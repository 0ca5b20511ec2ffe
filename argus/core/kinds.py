"""The enums every floor shares: the diagnosis :class:`Level` and the :class:`FindingKind` of each finding.

A kind's value is what the findings topic, the ClickHouse ``findings`` table and the ``--json`` contract carry
(a string). Every value is distinct across levels, so a kind names its level too (:attr:`FindingKind.level`).
History: in earlier builds the L3 late arrival seen in a collective kernel was ``compute_straggler``, the
value of the L2 straggler too; it is ``late_arrival`` now, and :meth:`FindingKind.of` still reads the old
pair (level ``L3``, ``compute_straggler``) as it.
"""

from __future__ import annotations

import enum

__all__ = ["FindingKind", "Level"]


class Level(enum.Enum):
    """Diagnosis level: L1 iteration time, L2 straggler rank + phase, L3 degraded kernel."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"


class FindingKind(enum.StrEnum):
    """What a finding is about; its level is :attr:`level`. A ``str``: a member equals its value."""

    #: L1: steps whose iteration time jumps above the job's recent ones.
    ITERATION_SPIKE = "iteration_spike"
    #: L1: a sustained rise of the iteration time from an onset step.
    STEP_REGRESSION = "step_regression"
    #: L1: no rank finished a step for longer than the job's steps take (a hang).
    JOB_STALLED = "job_stalled"
    #: L1: a stalled job made progress again.
    JOB_RESUMED = "job_resumed"
    #: L2: a rank whose compute phases are slower than its parallel-group peers'.
    COMPUTE_STRAGGLER = "compute_straggler"
    #: L2: a rank slower than its peers in one phase.
    PHASE_STRAGGLER = "phase_straggler"
    #: L2: a pipeline stage slower than the others as a whole.
    PP_STAGE_SLOW = "pp_stage_slow"
    #: L2: a rank that stopped sending heartbeats while its peers go on.
    RANK_SILENT = "rank_silent"
    #: L2: the ranks a hung collective waits for (its ranks are the suspects).
    HANG_WAVEFRONT = "hang_wavefront"
    #: L3: a compute kernel slower on a rank than on its peers.
    KERNEL_DEGRADED = "kernel_degraded"
    #: L3: a parallel group's collective transfers slower than the other groups'.
    LINK_DEGRADED = "link_degraded"
    #: L3: a rank that arrives last in a collective kernel, so its group peers wait for it.
    LATE_ARRIVAL = "late_arrival"
    #: L3: a rank slower than its peers across the job's compute kernels.
    RANK_DEGRADED = "rank_degraded"
    #: L3: the ranks of one host slow together beyond what their groups explain (an incident: its evidence
    #: is its ranks' and kernels' findings; see :mod:`argus.detectors.incidents`).
    NODE_DEGRADED = "node_degraded"

    @property
    def level(self) -> Level:
        """The level of findings of this kind."""
        return _LEVELS[self]

    @classmethod
    def of(cls, level: Level | str, value: str) -> FindingKind:
        """The kind of a stored finding from its level and kind string, old names included (module docstring).

        Raises ValueError for a value that is no kind."""
        lv = level.value if isinstance(level, Level) else level
        if lv == Level.L3.value and value == cls.COMPUTE_STRAGGLER.value:
            return cls.LATE_ARRIVAL
        return cls(value)


_LEVELS = {
    **dict.fromkeys((FindingKind.ITERATION_SPIKE, FindingKind.STEP_REGRESSION, FindingKind.JOB_STALLED,
                     FindingKind.JOB_RESUMED), Level.L1),
    **dict.fromkeys((FindingKind.COMPUTE_STRAGGLER, FindingKind.PHASE_STRAGGLER, FindingKind.PP_STAGE_SLOW,
                     FindingKind.RANK_SILENT, FindingKind.HANG_WAVEFRONT), Level.L2),
    **dict.fromkeys((FindingKind.KERNEL_DEGRADED, FindingKind.LINK_DEGRADED, FindingKind.LATE_ARRIVAL,
                     FindingKind.RANK_DEGRADED, FindingKind.NODE_DEGRADED), Level.L3),
}
