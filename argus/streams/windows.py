"""Event-time windows of kernel events per (job, rank), with the bookkeeping for at-least-once acks.

Pure state machine, no Kafka: the compression agent feeds it decoded :class:`KernelBatch` values with an
opaque integer ``token`` (its Kafka message) and gets back the windows that closed. Windows are aligned to
multiples of ``window_ns`` since the Unix epoch, so every rank's windows share boundaries and the cross-rank
comparison lines up. Time comes only from the records (``start_ns``), never from the worker's clock, so a
replay produces the same windows as the live run.

A window closes when the rank's watermark (its newest kernel start) passes ``window end + lateness``, or
when the rank sends ``end_of_stream``, or when the job ends (:meth:`WindowBuffer.flush_job`). Events for a
window that already closed are returned as *late* so the caller can dead-letter them (never silently lost).

Details and reasoning: docs/internals/streams.md.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from argus.schemas.records import KernelBatch

__all__ = ["OTHER_KERNEL", "ClosedWindow", "KernelNames", "WindowBuffer", "WindowUpdate", "beyond_skew"]

#: Kernel name of the bucket holding a window's events beyond its ``max_names`` distinct names.
OTHER_KERNEL = "[other kernels]"
#: Watermark of a rank that has no event yet.
_NO_WATERMARK = -(2**62)


def beyond_skew(start_ns: npt.NDArray[np.int64], watermark_ns: int, max_skew_ns: int | None) -> npt.NDArray[np.bool_]:
    """Which events start more than ``max_skew_ns`` after the rank's watermark (``None``: no limit).

    Before the rank's first event there is no watermark: :class:`WindowBuffer` passes its job's newest
    watermark then, and with none either (``watermark_ns`` at its floor) the batch's own median start stands
    in for it, so a single far-future event in a job's first batch is caught too.
    """
    if max_skew_ns is None or not start_ns.size:
        return np.zeros(start_ns.shape, dtype=bool)
    reference = watermark_ns
    if reference <= _NO_WATERMARK:
        reference = int(np.partition(start_ns, start_ns.size // 2)[start_ns.size // 2])
    return np.asarray(start_ns > reference + max_skew_ns)


class KernelNames:
    """A window's kernel-name dictionary, capped at ``limit`` distinct names (``None``: no cap).

    Ids are dense, in order of first appearance; once ``limit`` names are known every new name maps to the
    id of :data:`OTHER_KERNEL` (created on first use), and :attr:`folded_events` counts the events mapped there.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.ids: dict[str, int] = {}
        self.other: int | None = None
        self.folded_events = 0

    def map(self, names: tuple[str, ...], name_idx: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
        """Stable ids of the events whose batch-local name indices are ``name_idx`` into ``names``."""
        # The indices in use, ascending (what np.unique gives), by a count: a batch's dictionary is small.
        used = np.flatnonzero(np.bincount(name_idx)) if name_idx.size else np.empty(0, dtype=np.intp)
        lut = np.zeros(used[-1] + 1 if used.size else 0, dtype=np.int64)
        lut[used] = np.fromiter((self._id(names[i]) for i in used.tolist()), dtype=np.int64, count=used.size)
        kid = lut[name_idx]
        if self.other is not None:
            self.folded_events += int(np.count_nonzero(kid == self.other))
        return kid

    def _id(self, name: str) -> int:
        known = self.ids.get(name)
        if known is not None:
            return known
        if self.limit is None or len(self.ids) - (self.other is not None) < self.limit:
            new = self.ids[name] = len(self.ids)
            return new
        if self.other is None:
            self.other = self.ids.setdefault(OTHER_KERNEL, len(self.ids))
        return self.other

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.ids)


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
    #: Events folded into the :data:`OTHER_KERNEL` bucket because the window had too many kernel names.
    folded_events: int = 0
    #: Which piece of the (rank, window) this is: the position of the last message it holds events of.
    piece: int = 0
    #: Events that arrived after the window had closed (a further piece, ``late_pieces=True``).
    late: bool = False

    def __len__(self) -> int:
        return int(self.duration_ns.shape[0])

    def as_batch(self) -> KernelBatch:
        """The window's events as a kernel batch (to dead-letter them): every start is the window's start
        (the exact starts are not kept) and every step is -1 (unknown)."""
        n = len(self)
        return KernelBatch(job_id=self.job_id, rank=self.rank, seq=0, names=self.names,
                           name_idx=self.kernel_id.astype(np.uint32), stream=self.stream,
                           start_ns=np.full(n, self.start_ns, dtype=np.int64), duration_ns=self.duration_ns,
                           step=np.full(n, -1, dtype=np.int32))


@dataclass(frozen=True, eq=False)
class WindowUpdate:
    """What one :meth:`WindowBuffer.add` produced."""

    closed: list[ClosedWindow]
    late: KernelBatch | None
    #: Tokens no open window refers to any more (e.g. a batch with no events): safe to ack now.
    free_tokens: list[int]
    #: Events too far ahead of the rank's watermark (see :func:`beyond_skew`), not added.
    skewed: KernelBatch | None = None
    #: The batch was a copy of one already taken (same rank and ``seq``; ``late_pieces`` only): not added.
    duplicate: bool = False


class _Seqs:
    """The batch sequence numbers taken from one rank: all below ``below`` and those in ``extra``. A rank's
    batches arrive in order (one partition), so ``extra`` stays small; a replay that starts mid-stream counts
    the seqs before its first one as taken (they were, before the committed offset)."""

    def __init__(self) -> None:
        self.below: int | None = None
        self.extra: set[int] = set()

    def take(self, seq: int) -> bool:
        """Whether ``seq`` is new (then it is taken)."""
        if self.below is None:
            self.below = seq + 1
            return True
        if seq < self.below or seq in self.extra:
            return False
        self.extra.add(seq)
        while self.below in self.extra:
            self.extra.remove(self.below)
            self.below += 1
        return True


@dataclass
class _OpenWindow:
    names: KernelNames
    kernel_id: list[npt.NDArray[np.int64]] = field(default_factory=list)
    stream: list[npt.NDArray[np.uint32]] = field(default_factory=list)
    duration_ns: list[npt.NDArray[np.int64]] = field(default_factory=list)
    #: The token of each appended chunk (so one message's events can be taken out again).
    chunk_tokens: list[int] = field(default_factory=list)
    tokens: set[int] = field(default_factory=set)
    last_position: int = 0


@dataclass
class _RankState:
    windows: dict[int, _OpenWindow] = field(default_factory=dict)
    watermark_ns: int = _NO_WATERMARK
    closed_before_ns: int = _NO_WATERMARK


class WindowBuffer:
    """Tumbling event-time windows per (job, rank).

    Args:
        window_ns: window length in nanoseconds (> 0).
        lateness_ns: how long after a window's end (in the rank's event time) it still accepts events.
        max_skew_ns: events more than this (ns) ahead of the rank's watermark are returned as skewed, not
            added (default ``None``: no limit; the worker uses ``Settings.max_event_skew_ns``).
        max_names: distinct kernel names per (rank, window) before further names fold into
            :data:`OTHER_KERNEL` (default ``None``: no cap; the worker uses ``Settings.max_kernel_names``).
        late_pieces: close late events at once as further pieces of their windows instead of returning them
            as late (the worker; see the module docstring). Ranks that ended are remembered (the newest
            ``max_finished``), so their stragglers are pieces too, never windows that never close.
        max_finished: ended (job, rank) pairs remembered with ``late_pieces``.
    """

    def __init__(self, window_ns: int, lateness_ns: int, max_skew_ns: int | None = None,
                 max_names: int | None = None, late_pieces: bool = False, max_finished: int = 100_000) -> None:
        if window_ns <= 0 or lateness_ns < 0:
            raise ValueError("window_ns must be > 0 and lateness_ns >= 0")
        if (max_skew_ns is not None and max_skew_ns <= 0) or (max_names is not None and max_names <= 0):
            raise ValueError("max_skew_ns and max_names must be > 0 when given")
        self.window_ns = window_ns
        self.lateness_ns = lateness_ns
        self.max_skew_ns = max_skew_ns
        self.max_names = max_names
        self.late_pieces = late_pieces
        self.max_finished = max_finished
        self._ranks: dict[tuple[str, int], _RankState] = {}
        self._refs: defaultdict[int, int] = defaultdict(int)
        self._finished: OrderedDict[tuple[str, int], int] = OrderedDict()  # ended rank -> its last watermark
        self._seqs: dict[tuple[str, int], _Seqs] = {}
        # Each job's newest rank watermark (the newest max_finished jobs): the skew reference of a rank's
        # first batch, so a bogus batch that comes first from its rank is caught too.
        self._job_marks: OrderedDict[str, int] = OrderedDict()

    def _mark_job(self, job_id: str, watermark_ns: int) -> None:
        if watermark_ns > self._job_marks.get(job_id, _NO_WATERMARK):
            self._job_marks[job_id] = watermark_ns
        self._job_marks.move_to_end(job_id)
        while len(self._job_marks) > self.max_finished:
            self._job_marks.popitem(last=False)

    def ranks_of(self, job_id: str) -> set[int]:
        """The ranks of ``job_id`` with state here (open windows or a watermark)."""
        return {r for j, r in self._ranks if j == job_id}

    @property
    def open_windows(self) -> int:
        return sum(len(s.windows) for s in self._ranks.values())

    def open_jobs(self) -> set[str]:
        """The jobs with at least one open window."""
        return {key[0] for key, state in self._ranks.items() if state.windows}

    def add(self, batch: KernelBatch, token: int, position: int | None = None,
            now_ns: int | None = None) -> WindowUpdate:
        """Add a batch's events; returns closed windows, late events and tokens already free.

        ``position``: where the message sits in its rank's ordered stream (the worker passes its Kafka offset;
        default ``token``); it identifies the pieces the message ends (see the module docstring).
        ``now_ns``: the caller's clock (ns since the epoch; the worker passes its wall clock): a job's very first
        events more than ``max_skew_ns`` after it are skewed too (default ``None``: not checked). Only a
        bound on bogus timestamps: windows never depend on it.
        """
        key = (batch.job_id, batch.rank)
        pos = token if position is None else position
        ended = self.late_pieces and key in self._finished
        state = self._ranks.get(key)
        ahead = self._ahead(key, batch, state, ended, now_ns)
        skewed = _subset(batch, ahead) if ahead.any() else None
        if self.late_pieces:
            if skewed is not None and len(skewed) == len(batch) and not batch.end_of_stream:
                # Bogus as a whole: set aside without taking its seq, so a bogus seq cannot make the rank's
                # real batches look like copies.
                return WindowUpdate(closed=[], late=None, free_tokens=[token], skewed=skewed)
            seqs = self._seqs.get(key)
            if seqs is None:
                seqs = self._seqs[key] = _Seqs()
            if not seqs.take(batch.seq):
                # A re-sent batch (a producer retry, a re-import): its events were taken already.
                return WindowUpdate(closed=[], late=None, free_tokens=[token], duplicate=True)
        if ended:
            # The rank ended: whatever still comes is a further piece of windows already summarized -- except
            # events far beyond its last watermark, set aside as for a running rank.
            pieces = self._late_pieces(key, batch, ~ahead, pos) if len(batch) and not ahead.all() else []
            return WindowUpdate(closed=pieces, late=None, free_tokens=[token], skewed=skewed)
        if state is None:
            state = self._ranks[key] = _RankState()
        late: KernelBatch | None = None
        late_closed: list[ClosedWindow] = []
        if len(batch):
            wstart = (batch.start_ns // self.window_ns) * self.window_ns
            is_late = (wstart < state.closed_before_ns) & ~ahead
            keep = ~(ahead | is_late)
            if is_late.any():
                if self.late_pieces:
                    late_closed = self._late_pieces(key, batch, is_late, pos)
                else:
                    late = _subset(batch, is_late)
            if keep.any():
                self._file(state, batch, wstart, keep, token, pos)
        if batch.end_of_stream:
            closed = self._close(key, state, limit_ns=None)
            del self._ranks[key]
            self._ended(key, state.watermark_ns)
        else:
            closed = self._close(key, state, limit_ns=state.watermark_ns - self.lateness_ns)
        free = [] if self._refs.get(token, 0) else [token]
        return WindowUpdate(closed=late_closed + closed, late=late, free_tokens=free, skewed=skewed)

    def _ahead(self, key: tuple[str, int], batch: KernelBatch, state: _RankState | None, ended: bool,
               now_ns: int | None) -> npt.NDArray[np.bool_]:
        """Which of ``batch``'s events start beyond the skew: past the rank's watermark (its last one where it
        ended; for its first events its job's newest), or for a job's very first events past ``now_ns``."""
        if ended:
            reference = self._finished[key]
        elif state is not None and state.watermark_ns > _NO_WATERMARK:
            reference = state.watermark_ns
        else:  # the rank's first events: its job's newest watermark, when another rank of the job has one
            reference = self._job_marks.get(batch.job_id, _NO_WATERMARK)
        ahead = beyond_skew(batch.start_ns, reference, self.max_skew_ns)
        if reference <= _NO_WATERMARK and now_ns is not None and self.max_skew_ns is not None:
            # The job's very first events: nothing of the job to compare with, but no kernel can start
            # more than the skew after the worker's clock (a replay's old events never trip this).
            ahead |= batch.start_ns > now_ns + self.max_skew_ns
        return ahead

    def _file(self, state: _RankState, batch: KernelBatch, wstart: npt.NDArray[np.int64],
              keep: npt.NDArray[np.bool_], token: int, pos: int) -> None:
        """File the ``keep`` events of ``batch`` (``wstart``: each event's window start, ns) into their open
        windows, holding ``token`` until those close, and move the rank's watermark."""
        idx, stream, dur = batch.name_idx, batch.stream, batch.duration_ns
        all_kept = bool(keep.all())
        if not all_kept:  # the common batch keeps every event: no copies then
            wstart, idx, stream, dur = wstart[keep], idx[keep], stream[keep], dur[keep]
        for ws, mask in _by_window(wstart):
            win = state.windows.get(ws)
            if win is None:
                win = state.windows[ws] = _OpenWindow(KernelNames(self.max_names))
            win.kernel_id.append(win.names.map(batch.names, idx[mask]))
            win.stream.append(stream[mask])
            win.duration_ns.append(dur[mask])
            win.chunk_tokens.append(token)
            win.last_position = max(win.last_position, pos)
            if token not in win.tokens:
                win.tokens.add(token)
                self._refs[token] += 1
        # Skewed events never move the watermark (late ones are behind it anyway).
        kept = batch.start_ns if all_kept else batch.start_ns[keep]
        state.watermark_ns = max(state.watermark_ns, int(kept.max()))
        self._mark_job(batch.job_id, state.watermark_ns)

    def flush_job(self, job_id: str, ranks: set[int] | None = None) -> list[ClosedWindow]:
        """Close every open window of ``job_id`` (of ``ranks`` only, if given): the job ended."""
        closed: list[ClosedWindow] = []
        for key in [k for k in self._ranks if k[0] == job_id and (ranks is None or k[1] in ranks)]:
            state = self._ranks.pop(key)
            closed.extend(self._close(key, state, limit_ns=None))
            self._ended(key, state.watermark_ns)
        return closed

    def _ended(self, key: tuple[str, int], watermark_ns: int) -> None:
        if self.late_pieces:
            self._finished[key] = watermark_ns
            self._finished.move_to_end(key)
            while len(self._finished) > self.max_finished:
                self._seqs.pop(self._finished.popitem(last=False)[0], None)

    def _late_pieces(self, key: tuple[str, int], batch: KernelBatch, mask: npt.NDArray[np.bool_],
                     position: int) -> list[ClosedWindow]:
        """The events of ``batch`` under ``mask`` as closed pieces of their windows (one per window), each
        identified by ``position``; no token is held for them (they are emitted with the message)."""
        wstart = (batch.start_ns[mask] // self.window_ns) * self.window_ns
        idx, stream, dur = batch.name_idx[mask], batch.stream[mask], batch.duration_ns[mask]
        out = []
        for ws in np.unique(wstart).tolist():
            sel = wstart == ws
            names = KernelNames(self.max_names)
            kid = names.map(batch.names, idx[sel])
            out.append(ClosedWindow(job_id=key[0], rank=key[1], start_ns=ws, end_ns=ws + self.window_ns,
                                    names=names.names, kernel_id=kid, stream=stream[sel], duration_ns=dur[sel],
                                    tokens=frozenset(), folded_events=names.folded_events, piece=position,
                                    late=True))
        return out

    def release(self, window: ClosedWindow) -> list[int]:
        """Mark ``window`` emitted; returns the tokens with no remaining open or in-flight windows."""
        free: list[int] = []
        for token in window.tokens:
            self._refs[token] -= 1
            if self._refs[token] <= 0:
                del self._refs[token]
                free.append(token)
        return sorted(free)

    def discard(self, token: int) -> None:
        """Take the events of message ``token`` out of every open window (its processing failed and it was
        dead-lettered whole), so they are not summarized as well."""
        for state in self._ranks.values():
            for ws, win in list(state.windows.items()):
                if token not in win.tokens:
                    continue
                keep = [i for i, t in enumerate(win.chunk_tokens) if t != token]
                win.kernel_id = [win.kernel_id[i] for i in keep]
                win.stream = [win.stream[i] for i in keep]
                win.duration_ns = [win.duration_ns[i] for i in keep]
                win.chunk_tokens = [win.chunk_tokens[i] for i in keep]
                win.tokens.discard(token)
                if not win.chunk_tokens:
                    del state.windows[ws]
        self._refs.pop(token, None)

    def clear(self) -> None:
        """Forget all state (partitions were revoked: the new owner re-reads from the committed offset)."""
        self._ranks.clear()
        self._refs.clear()
        self._finished.clear()
        self._seqs.clear()
        self._job_marks.clear()

    def _close(self, key: tuple[str, int], state: _RankState, limit_ns: int | None) -> list[ClosedWindow]:
        due = sorted(ws for ws in state.windows if limit_ns is None or ws + self.window_ns <= limit_ns)
        if not due:
            return []
        out = []
        for ws in due:
            win = state.windows.pop(ws)
            out.append(ClosedWindow(
                job_id=key[0], rank=key[1], start_ns=ws, end_ns=ws + self.window_ns, names=win.names.names,
                kernel_id=np.concatenate(win.kernel_id), stream=np.concatenate(win.stream),
                duration_ns=np.concatenate(win.duration_ns), tokens=frozenset(win.tokens),
                folded_events=win.names.folded_events, piece=win.last_position,
            ))
        state.closed_before_ns = max(state.closed_before_ns, due[-1] + self.window_ns)
        return out


def _by_window(wstart: npt.NDArray[np.int64]) -> list[tuple[int, npt.NDArray[np.bool_] | slice]]:
    """Each window start of ``wstart`` (ascending) with the events in it: a batch spans a few steps of one
    rank, so it usually falls in one window, which needs no sort and no mask."""
    first, last = int(wstart.min()), int(wstart.max())
    if first == last:
        return [(first, slice(None))]
    starts, inverse = np.unique(wstart, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [(ws, inverse == i) for i, ws in enumerate(starts.tolist())]


def _subset(batch: KernelBatch, mask: npt.NDArray[np.bool_]) -> KernelBatch:
    return KernelBatch(
        job_id=batch.job_id, rank=batch.rank, seq=batch.seq, names=batch.names, host=batch.host,
        name_idx=batch.name_idx[mask], stream=batch.stream[mask], start_ns=batch.start_ns[mask],
        duration_ns=batch.duration_ns[mask], step=batch.step[mask],
    )
