"""The :class:`JobContext` record: what one stream worker knows of a job that others need (see
``schemas/job_context.v2.avsc``; v1 still read)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from argus.core.errors import SchemaError
from argus.schemas.records import ParallelGroup, Record, _bounded, _same_length, _times

__all__ = ["CONTEXT_JOB_PART", "JobContext"]

#: The part of the job agent's context; L3 parts are ``l3/<p>``.
CONTEXT_JOB_PART = "job"


@dataclass(frozen=True)
class JobContext(Record):
    """One part of a job's shared context. Times in integer nanoseconds since the Unix epoch."""

    SCHEMA: ClassVar[str] = "job_context"

    job_id: str
    part: str
    time_ns: int
    topology: bytes | None = None
    group_streams: tuple[int, ...] = ()
    group_kinds: tuple[ParallelGroup, ...] = ()
    stragglers: tuple[int, ...] = ()
    step_starts_ns: tuple[int, ...] = ()
    median_step_ns: float = 0.0
    final: bool = False
    totals_kernel: tuple[str, ...] = ()
    totals_stream: tuple[int, ...] = ()
    totals_rows: tuple[int, ...] = ()
    totals_rank: tuple[int, ...] = ()
    totals_ns: tuple[float, ...] = ()
    totals_calls: tuple[float, ...] = ()
    totals_median_ns: tuple[float, ...] = ()
    onset_rank: tuple[int, ...] = ()
    onset_ns: tuple[int, ...] = ()
    token_rank: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"group_kinds": ParallelGroup}

    def check(self) -> None:
        what = f"job context {self.job_id}/{self.part}"
        if not self.job_id or not (self.part == CONTEXT_JOB_PART or self.part.startswith("l3/")):
            raise SchemaError(f"{what}: invalid job_id or part")
        _times(what, "time_ns", self.time_ns)
        _times(what, "step_starts_ns", self.step_starts_ns)
        _same_length(what, self, ("group_kinds",), len(self.group_streams), "the number of group_streams")
        _same_length(what, self, ("totals_stream", "totals_rows"), len(self.totals_kernel),
                     "the number of totals_kernel")
        _bounded(what, "totals_rows", self.totals_rows, 0, 2**31 - 1)
        _same_length(what, self, ("totals_ns", "totals_calls"), len(self.totals_rank), "the number of totals_rank")
        if self.totals_median_ns and len(self.totals_median_ns) != len(self.totals_rank):
            raise SchemaError(f"{what}: totals_median_ns has {len(self.totals_median_ns)} entries, not one per "
                              f"totals_rank ({len(self.totals_rank)}) or none")
        if sum(self.totals_rows) != len(self.totals_rank):
            raise SchemaError(f"{what}: totals_rows add up to {sum(self.totals_rows)}, not {len(self.totals_rank)}")
        _bounded(what, "stragglers", self.stragglers, 0, 2**31 - 1)
        _same_length(what, self, ("onset_ns",), len(self.onset_rank), "the number of onset_rank")
        _same_length(what, self, ("tokens",), len(self.token_rank), "the number of token_rank")
        _times(what, "onset_ns", self.onset_ns)
        _bounded(what, "onset_rank", self.onset_rank, 0, 2**31 - 1)
        _bounded(what, "token_rank", self.token_rank, 0, 2**31 - 1)
        _bounded(what, "tokens", self.tokens, 0, 2**63 - 1)
        _bounded(what, "totals_rank", self.totals_rank, 0, 2**31 - 1)
