"""What the job agent does, as values: the effects a :class:`~argus.streams.job_router.JobRouter` answers with.

A :class:`JobStep` holds them in the order the Faust agent in :mod:`argus.streams.diagnosis_agents` must carry
them out, each delivered (awaited) before the next: so a message's :class:`Ack` comes after everything it
caused. Handles (``H``) are the router's opaque messages (a Faust event in the worker, anything in a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from argus.schemas.job_context import JobContext
from argus.schemas.records import Finding, Heartbeat, JobLifecycle, JobTopology, PhaseBatch, Step

__all__ = ["Abandon", "Ack", "Effect", "FinishParts", "Forget", "JobRecord", "JobStep", "Mark", "Publish", "Reject",
           "Release", "Share"]

H = TypeVar("H")

#: What the job agent reads (all keyed by job).
JobRecord = Step | PhaseBatch | JobTopology | JobLifecycle | Heartbeat


@dataclass(frozen=True)
class Publish:
    """Findings to publish (already stamped and filtered: each id once); ``hangs``: liveness findings."""

    findings: tuple[Finding, ...]
    hangs: bool = False


@dataclass(frozen=True)
class Share:
    """The job's context (part ``job``) to write to the context topic, for L3 parts on other workers."""

    context: JobContext


@dataclass(frozen=True)
class Mark:
    """A DIAGNOSED record to write; once delivered, tell :meth:`JobRouter.marked` (with ``release``)."""

    record: JobLifecycle
    release: bool = True


@dataclass(frozen=True)
class Abandon:
    """An ABANDONED record to write to the lifecycle topic (the job closes when it is read back)."""

    record: JobLifecycle


@dataclass(frozen=True)
class Reject(Generic[H]):
    """A dead letter for ``handle`` (stage ``diagnose-jobs``), delivered before anything after it."""

    handle: H
    reason: str
    job: str
    rank: int | None = None


@dataclass(frozen=True)
class Ack(Generic[H]):
    """Messages to ack now: everything they caused was delivered by the effects before this one."""

    handles: tuple[H, ...]


@dataclass(frozen=True)
class FinishParts:
    """The job's L1/L2 part is final: judge its L3 parts that waited for its final steps (the L3 agent's)."""

    job_id: str


@dataclass(frozen=True)
class Release:
    """Ask :meth:`JobRouter.release` for what the job's end frees now (after its waiting L3 parts ran)."""

    job_id: str


@dataclass(frozen=True)
class Forget:
    """Every part of the job is DIAGNOSED and its context here dropped: the L3 router's totals go too, and,
    when ``tombstones``, this worker wrote the job's context and leaves tombstones on the context topic."""

    job_id: str
    tombstones: bool


#: One thing for the agent to do; a :class:`JobStep` holds them in the order they must be carried out.
Effect = Publish | Share | Mark | Abandon | Reject[H] | Ack[H] | FinishParts | Release | Forget


@dataclass(frozen=True)
class JobStep(Generic[H]):
    """What the agent does for one record or timer tick: ``effects``, each in turn, each delivered (awaited)
    before the next."""

    effects: tuple[Effect[H], ...] = ()

    @property
    def acks(self) -> list[H]:
        return [h for e in self.effects if isinstance(e, Ack) for h in e.handles]

    @property
    def findings(self) -> list[Finding]:
        return [f for e in self.effects if isinstance(e, Publish) for f in e.findings]

    @property
    def rejected(self) -> list[Reject[H]]:
        return [e for e in self.effects if isinstance(e, Reject)]

    @property
    def marks(self) -> list[JobLifecycle]:
        return [e.record for e in self.effects if isinstance(e, Mark)]
