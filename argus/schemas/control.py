"""The :class:`ControlCommand` record (``schemas/control_command.v1.avsc``): what ``argus control`` asks the ranks of a
running job to do, and the runtime settings a rank accepts (:data:`RUNTIME_SETTINGS`).

Both the command line (which refuses a bad command before it is written) and the rank (which refuses one
written by another version, and says why in its heartbeat) check commands with :func:`runtime_value`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from argus.core.errors import SchemaError
from argus.schemas.records import _INT32, Record, _bounded, _times

__all__ = ["RUNTIME_SETTINGS", "ControlAction", "ControlCommand", "runtime_value"]


class ControlAction(enum.Enum):
    PAUSE_KERNELS = "PAUSE_KERNELS"
    RESUME_KERNELS = "RESUME_KERNELS"
    SAMPLE_RANKS = "SAMPLE_RANKS"
    SET = "SET"

    @property
    def slot(self) -> str:
        """What the command sets on a rank: the newest command per slot (and ranks) decides it."""
        if self in (ControlAction.PAUSE_KERNELS, ControlAction.RESUME_KERNELS):
            return "kernels"
        return "sample" if self is ControlAction.SAMPLE_RANKS else "set"


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        v = float(text)
        if not (math.isfinite(v) and lo < v <= hi):
            raise ValueError(f"must be in ({lo:g}, {hi:g}], got {text!r}")
        return v
    return parse


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text)
        if not lo <= v <= hi:
            raise ValueError(f"must be in [{lo}, {hi}], got {text!r}")
        return v
    return parse


#: The settings a running rank changes on ``argus control set KEY=VALUE``, with the parser of each value:
#: ``heartbeat_interval_s`` (seconds between heartbeats, (0, 3600]), ``kernel_batch_events`` (kernel events per
#: KernelBatch, [1, 1048576]) and ``kernel_max_latency_s`` (longest a partial kernel batch waits, (0, 60] s).
RUNTIME_SETTINGS: dict[str, Callable[[str], float | int]] = {
    "heartbeat_interval_s": _float_in(0.0, 3600.0),
    "kernel_batch_events": _int_in(1, 1 << 20),
    "kernel_max_latency_s": _float_in(0.0, 60.0),
}


def runtime_value(key: str, text: str) -> float | int:
    """The value of runtime setting ``key`` given as ``text``.

    Raises:
        SchemaError: ``key`` is not a runtime setting, or ``text`` is not a valid value for it.
    """
    parse = RUNTIME_SETTINGS.get(key)
    if parse is None:
        raise SchemaError(f"{key!r} is not a runtime setting (one of {', '.join(sorted(RUNTIME_SETTINGS))})")
    try:
        return parse(text)
    except ValueError as exc:
        raise SchemaError(f"{key}: {exc}") from exc


@dataclass(frozen=True)
class ControlCommand(Record):
    """One command to the ranks of a job (see the schema's doc). ``ranks`` empty: every rank; ``count``
    (SAMPLE_RANKS) how many ranks trace kernels, 0 for all; ``key``/``value`` (SET) a runtime setting."""

    SCHEMA: ClassVar[str] = "control_command"

    job_id: str
    command_id: str
    time_ns: int
    action: ControlAction
    ranks: tuple[int, ...] = ()
    count: int = 0
    key: str = ""
    value: str = ""

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"action": ControlAction}

    def applies_to(self, rank: int) -> bool:
        return not self.ranks or rank in self.ranks

    def kafka_key(self) -> bytes:
        """``<job>/<slot>/<ranks>``: compaction keeps the newest command per slot (a SET: per setting) and rank
        selection, which decides that slot on those ranks (see docs/rank-control.md)."""
        slot = f"set:{self.key}" if self.action is ControlAction.SET else self.action.slot
        ranks = ",".join(map(str, sorted(set(self.ranks)))) or "all"
        return f"{self.job_id}/{slot}/{ranks}".encode()

    def check(self) -> None:
        what = f"control {self.job_id} {self.action.value}"
        if not self.job_id or "/" in self.job_id:
            raise SchemaError(f"{what}: job_id must be a non-empty name without '/'")
        if not self.command_id:
            raise SchemaError(f"{what}: empty command_id")
        _times(what, "time_ns", self.time_ns)
        _bounded(what, "ranks", self.ranks, 0, _INT32[1])
        _bounded(what, "count", self.count, 0, _INT32[1])
        # A SET's key and value are checked where they are applied (runtime_value): a rank of another version
        # refuses an unknown setting in its heartbeat instead of dropping the command unread.
        if self.action is ControlAction.SET:
            if not self.key:
                raise SchemaError(f"{what}: SET without a key")
        elif self.key or self.value:
            raise SchemaError(f"{what}: key/value are for SET only")
