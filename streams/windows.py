"""Event-time windows of kernel events per (job, rank), with the bookkeeping for at-least-once acks.

Pure state machine, no Kafka: the compression agent feeds it decoded :class:`KernelBatch` values with an
opaque integer ``token`` (its Kafka message) and gets back the windows that closed. Windows are aligned to
multiples of ``window_ns`` since the Unix epoch, so every rank's windows share boundaries and the cross-rank
comparison lines up. Time comes only from the records (``start_ns``), never from the worker's clock, so a
replay produces the same windows as the live run.

A window closes when the rank's watermark (its newest kernel start) passes ``window end + lateness``, or
when the rank sends ``end_of_stream``, or when the job ends (:meth:`WindowBuffer.flush_job`). Events for a
window that already closed are returned as *late* so the caller can dead-letter them (never silently lost).

A token stays referenced while any open or in-flight window holds one of its events; :meth:`release` returns
the tokens whose windows have all been emitted, i.e. the Kafka messages that are safe to commit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from schemas.records import KernelBatch

__all__ = ["ClosedWindow", "WindowBuffer", "WindowUpdate"]


@dataclass(frozen=True, eq=False)
class ClosedWindow:
    """All kernel events of one (job, rank) in ``[start_ns, end_ns)``, ready to summarize."""

    job_id: str
    rank: int
    start_ns: int
    end_ns: int
    names: tuple[str, ...]
    kernel_id: npt.NDArray[np.int64]
    stream: npt.NDArray[np.uint32]
    duration_ns: npt.NDArray[np.int64]
    tokens: frozenset[int]

    def __len__(self) -> int:
        return int(self.duration_ns.shape[0])


@dataclass(frozen=True, eq=False)
class WindowUpdate:
    """What one :meth:`WindowBuffer.add` produced."""

    closed: list[ClosedWindow]
    late: KernelBatch | None
    #: Tokens no open window refers to any more (e.g. a batch with no events): safe to ack now.
    free_tokens: list[int]


@dataclass
class _OpenWindow:
    kernel_id: list[npt.NDArray[np.int64]] = field(default_factory=list)
    stream: list[npt.NDArray[np.uint32]] = field(default_factory=list)
    duration_ns: list[npt.NDArray[np.int64]] = field(default_factory=list)
    tokens: set[int] = field(default_factory=set)


@dataclass
class _RankState:
    names: dict[str, int] = field(default_factory=dict)
    windows: dict[int, _OpenWindow] = field(default_factory=dict)
    watermark_ns: int = -(2**62)
    closed_before_ns: int = -(2**62)


class WindowBuffer:
    """Tumbling event-time windows per (job, rank).

    Args:
        window_ns: window length in nanoseconds (> 0).
        lateness_ns: how long after a window's end (in the rank's event time) it still accepts events.
    """

    def __init__(self, window_ns: int, lateness_ns: int) -> None:
        if window_ns <= 0 or lateness_ns < 0:
            raise ValueError("window_ns must be > 0 and lateness_ns >= 0")
        self.window_ns = window_ns
        self.lateness_ns = lateness_ns
        self._ranks: dict[tuple[str, int], _RankState] = {}
        self._refs: defaultdict[int, int] = defaultdict(int)

    @property
    def open_windows(self) -> int:
        return sum(len(s.windows) for s in self._ranks.values())

    def add(self, batch: KernelBatch, token: int) -> WindowUpdate:
        """Add a batch's events; returns closed windows, late events and tokens already free."""
        key = (batch.job_id, batch.rank)
        state = self._ranks.get(key)
        if state is None:
            state = self._ranks[key] = _RankState()
        late: KernelBatch | None = None
        if len(batch):
            # Map the batch's own name dictionary onto the rank's stable kernel ids.
            local = np.fromiter((state.names.setdefault(n, len(state.names)) for n in batch.names),
                                dtype=np.int64, count=len(batch.names))
            kid = local[batch.name_idx]
            wstart = (batch.start_ns // self.window_ns) * self.window_ns
            is_late = wstart < state.closed_before_ns
            if is_late.any():
                late = _subset(batch, is_late)
                keep = ~is_late
                kid, wstart = kid[keep], wstart[keep]
                stream, dur = batch.stream[keep], batch.duration_ns[keep]
            else:
                stream, dur = batch.stream, batch.duration_ns
            if wstart.size:
                starts, inverse = np.unique(wstart, return_inverse=True)
                for i, ws in enumerate(starts.tolist()):
                    mask = inverse == i
                    win = state.windows.get(ws)
                    if win is None:
                        win = state.windows[ws] = _OpenWindow()
                    win.kernel_id.append(kid[mask])
                    win.stream.append(stream[mask])
                    win.duration_ns.append(dur[mask])
                    if token not in win.tokens:
                        win.tokens.add(token)
                        self._refs[token] += 1
                state.watermark_ns = max(state.watermark_ns, int(batch.start_ns.max()))
        if batch.end_of_stream:
            closed = self._close(key, state, limit_ns=None)
            del self._ranks[key]
        else:
            closed = self._close(key, state, limit_ns=state.watermark_ns - self.lateness_ns)
        free = [] if self._refs.get(token, 0) else [token]
        return WindowUpdate(closed=closed, late=late, free_tokens=free)

    def flush_job(self, job_id: str, ranks: set[int] | None = None) -> list[ClosedWindow]:
        """Close every open window of ``job_id`` (of ``ranks`` only, if given): the job ended."""
        closed: list[ClosedWindow] = []
        for key in [k for k in self._ranks if k[0] == job_id and (ranks is None or k[1] in ranks)]:
            closed.extend(self._close(key, self._ranks.pop(key), limit_ns=None))
        return closed

    def release(self, window: ClosedWindow) -> list[int]:
        """Mark ``window`` emitted; returns the tokens with no remaining open or in-flight windows."""
        free: list[int] = []
        for token in window.tokens:
            self._refs[token] -= 1
            if self._refs[token] <= 0:
                del self._refs[token]
                free.append(token)
        return sorted(free)

    def clear(self) -> None:
        """Forget all state (partitions were revoked: the new owner re-reads from the committed offset)."""
        self._ranks.clear()
        self._refs.clear()

    def _close(self, key: tuple[str, int], state: _RankState, limit_ns: int | None) -> list[ClosedWindow]:
        due = sorted(ws for ws in state.windows if limit_ns is None or ws + self.window_ns <= limit_ns)
        if not due:
            return []
        names = tuple(state.names)
        out = []
        for ws in due:
            win = state.windows.pop(ws)
            out.append(ClosedWindow(
                job_id=key[0], rank=key[1], start_ns=ws, end_ns=ws + self.window_ns, names=names,
                kernel_id=np.concatenate(win.kernel_id), stream=np.concatenate(win.stream),
                duration_ns=np.concatenate(win.duration_ns), tokens=frozenset(win.tokens),
            ))
        state.closed_before_ns = max(state.closed_before_ns, due[-1] + self.window_ns)
        return out


def _subset(batch: KernelBatch, mask: npt.NDArray[np.bool_]) -> KernelBatch:
    return KernelBatch(
        job_id=batch.job_id, rank=batch.rank, seq=batch.seq, names=batch.names, host=batch.host,
        name_idx=batch.name_idx[mask], stream=batch.stream[mask], start_ns=batch.start_ns[mask],
        duration_ns=batch.duration_ns[mask], step=batch.step[mask],
    )
