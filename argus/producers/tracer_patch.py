"""Collectives timed without code changes (a mixin of :class:`~argus.producers.tracer.Tracer`): the opt-in wrapper on
``torch.distributed``'s collective functions, and the timing that the DDP/FSDP hooks share with it.

:meth:`PatchMixin.patch_collectives` (``argus.attach(..., patch_collectives=True)`` or
``ARGUS_PATCH_COLLECTIVES=1``) replaces ``torch.distributed``'s collectives by wrappers that call the original
once with the caller's arguments and time it inside an iteration, tagged with its parallel group
(:meth:`PatchMixin.group_kind`).

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from argus.producers.cuda_timing import EventPool, PhaseOpener, PhaseRec, StepRec
from argus.producers.groups import members
from argus.producers.heartbeat import LiveState
from argus.producers.topology import build_topology, group_index, group_members
from argus.producers.tracer_collectives import default_name, guarded, inside_launch
from argus.schemas.records import JobTopology, ParallelGroup, PhaseKind

try:
    import torch as _torch
except ImportError:  # pragma: no cover
    _torch = None  # type: ignore[assignment]
torch: Any = _torch

__all__ = ["PATCHED", "PatchMixin", "guarded", "inside_launch"]

log = logging.getLogger(__name__)

_perf = time.perf_counter_ns

#: function -> (kind, name of its tensor argument, of its group argument, of its async_op argument or
#: True/False when the function is always async / sync).
PATCHED: dict[str, tuple[PhaseKind, str, str, str | bool]] = {
    "all_reduce": (PhaseKind.ALL_REDUCE, "tensor", "group", "async_op"),
    "all_gather_into_tensor": (PhaseKind.ALL_GATHER, "output_tensor", "group", "async_op"),
    "all_gather_single": (PhaseKind.ALL_GATHER, "output_tensor", "group", "async_op"),
    "reduce_scatter_tensor": (PhaseKind.REDUCE_SCATTER, "output", "group", "async_op"),
    "reduce_scatter_single": (PhaseKind.REDUCE_SCATTER, "output", "group", "async_op"),
    "broadcast": (PhaseKind.BROADCAST, "tensor", "group", "async_op"),
    "all_to_all_single": (PhaseKind.ALL_TO_ALL, "output", "group", "async_op"),
    "send": (PhaseKind.SEND_RECV, "tensor", "group", False),
    "recv": (PhaseKind.SEND_RECV, "tensor", "group", False),
    "isend": (PhaseKind.SEND_RECV, "tensor", "group", True),
    "irecv": (PhaseKind.SEND_RECV, "tensor", "group", True),
    "batch_isend_irecv": (PhaseKind.SEND_RECV, "p2p_op_list", "", True),
}
_ORIGINALS: dict[str, Any] = {}
_OWNER: list[Any] = []  # the tracer whose wrappers are installed (one per process)


def _wait_all(work: Any) -> None:
    for w in work if isinstance(work, (list, tuple)) else (work,):
        if w is not None:
            w.wait()


class _TimedWork:
    """A host Work (or one of a batch) whose ``wait()`` ends a phase once every Work of the batch waited."""

    def __init__(self, work: Any, done: Callable[[], None], pending: list[int]) -> None:
        self._work, self._done, self._pending, self._waited = work, done, pending, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if not self._waited:
            self._waited = True
            self._pending[0] -= 1
            if self._pending[0] == 0:
                self._done()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class PatchMixin(PhaseOpener):
    """Group tagging, shared collective timing and the ``torch.distributed`` patch."""

    _pool: EventPool | None
    _cur: StepRec | None
    _closed: bool
    _live: LiveState
    _topology: JobTopology | None
    _group_kinds: dict[int, ParallelGroup]
    _dims: tuple[int | None, int, int, int]
    job_id: str
    rank: int
    world_size: int
    _comm_stream: Callable[[Any, Any], Any]

    def _open(self, name: str, kind: PhaseKind, group: ParallelGroup, stream: Any, host: bool = False,
              track: bool = True) -> PhaseRec | None:
        raise NotImplementedError  # the Tracer's (``track=False``: not on the heartbeat's nesting stack)

    # -- parallel group of a process group --------------------------------------------------------------------

    def group_kind(self, group: Any) -> ParallelGroup:
        """The parallel group kind of a ``torch.distributed`` process group (None: the default group)."""
        key = 0 if group is None else id(group)
        kind = self._group_kinds.get(key)
        if kind is None:
            kind = self._group_kinds[key] = self._infer_kind(group)
        return kind

    def set_group_kind(self, group: Any, kind: ParallelGroup) -> None:
        """Tag the collectives of ``group`` (a process group; None: the default group) with ``kind``."""
        self._group_kinds[0 if group is None else id(group)] = kind

    def _local_topology(self) -> JobTopology | None:
        if self._topology is not None:
            return self._topology
        dp, tp, pp, ep = self._dims
        try:
            return build_topology(self.job_id, dp or max(1, self.world_size // (tp * pp)), tp, pp, ep)
        except ValueError:
            return None

    def _infer_kind(self, group: Any) -> ParallelGroup:
        topo = self._local_topology()
        try:
            default = group is None or (torch is not None and group is torch.distributed.group.WORLD)
        except Exception:
            default = group is None
        ranks = list(range(self.world_size)) if default else members(group)
        if topo is None or ranks is None or self.rank not in topo.rank:
            return ParallelGroup.NONE
        for kind in (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.EP):
            if group_members(topo, kind, group_index(topo, kind, self.rank)) == ranks:
                return kind
        return ParallelGroup.NONE

    # -- shared timing ---------------------------------------------------------------------------------------

    def _timed_launch(self, name: str, kind: PhaseKind, pgroup: ParallelGroup, first: Any, group: Any,
                      async_op: bool, launch: Callable[[], Any], proxy: bool = False) -> Any:
        """Run ``launch`` (a collective returning None or a Work, or a list of them) once, timed as a phase
        of the open iteration; returns its result (see the module docstring for the timing)."""
        if self._closed or self._cur is None:
            return guarded(launch)
        live, rec, cur_stream = self._live, None, None
        live.issue(kind, pgroup, _perf())
        seq = live.coll_seq
        cuda = self._pool is not None and bool(getattr(first, "is_cuda", False))
        try:
            if cuda:
                cur_stream = torch.cuda.current_stream(first.device)
                rec = self._open(name, kind, pgroup, cur_stream)
            else:
                rec = self._open(name, kind, pgroup, None, host=True, track=not async_op)
        except Exception as exc:
            self._error(f"collective {name} start", exc)
        result = guarded(launch)
        if rec is None:
            return result
        try:
            if cuda:
                if async_op and result is not None:
                    comm = self._comm_stream(first.device, group)
                    comm.wait_stream(cur_stream)
                    with torch.cuda.stream(comm):
                        _wait_all(result)
                    rec.on = comm
                    live.coll_work = result
                self._close(rec)
                return result
            if not async_op or result is None:
                self._close(rec)
                live.done(pgroup, seq)
                return result
            return self._host_async(rec, pgroup, seq, result, proxy)
        except Exception as exc:
            self._error(f"collective {name} end", exc)
            return result

    def _host_async(self, rec: PhaseRec, pgroup: ParallelGroup, seq: int, result: Any, proxy: bool) -> Any:
        live = self._live

        def done(*_: Any) -> None:
            try:
                self._close(rec)
                live.done(pgroup, seq)
            except Exception as exc:
                self._error("collective completion", exc)

        works = result if isinstance(result, (list, tuple)) else [result]
        try:
            futs = [w.get_future() for w in works]
        except Exception:
            futs = []
        if futs:
            left = [len(futs)]

            def one(_f: Any) -> None:
                left[0] -= 1
                if left[0] == 0:
                    done()

            for f in futs:
                f.add_done_callback(one)
            return result
        if not proxy:  # no way to see the end: the phase stays open and is dropped (counted) with its step
            return result
        pending = [len(works)]
        wrapped = [_TimedWork(w, done, pending) for w in works]
        return wrapped if isinstance(result, (list, tuple)) else wrapped[0]

    def _timed_future(self, name: str, kind: PhaseKind, pgroup: ParallelGroup, first: Any, group: Any,
                      launch: Callable[[], Any]) -> Any:
        """Run ``launch`` (returning a ``torch.futures.Future``, as a DDP communication hook does) once, timed
        until the future completes; returns a future of the same value."""
        if self._closed or self._cur is None:
            return guarded(launch)
        live, rec, comm = self._live, None, None
        live.issue(kind, pgroup, _perf())
        seq = live.coll_seq
        cuda = self._pool is not None and bool(getattr(first, "is_cuda", False))
        try:
            if cuda:
                comm = self._comm_stream(first.device, group)
                comm.wait_stream(torch.cuda.current_stream(first.device))
                rec = self._open(name, kind, pgroup, comm, track=False)
            else:
                rec = self._open(name, kind, pgroup, None, host=True, track=False)
        except Exception as exc:
            self._error(f"collective {name} start", exc)
        fut = guarded(launch)
        if rec is None:
            return fut

        def done(f: Any) -> Any:
            try:
                if comm is not None:
                    comm.wait_stream(torch.cuda.current_stream(first.device))
                self._close(rec)
                live.done(pgroup, seq)
            except Exception as exc:
                self._error(f"collective {name} end", exc)
            return f.value()

        return fut.then(done)

    # -- the patch -------------------------------------------------------------------------------------------

    def patch_collectives(self) -> bool:
        """Install the ``torch.distributed`` wrappers (see the module docstring) for this tracer. Idempotent;
        returns whether they are installed. Undone by :meth:`unpatch_collectives` and at :meth:`close`."""
        if torch is None:
            return False
        try:
            dist = torch.distributed
            if _OWNER:
                _OWNER[0] = self  # a later tracer of the process takes the wrappers over
                return True
            for fname, spec in PATCHED.items():
                orig = getattr(dist, fname, None)
                if orig is None:
                    continue
                _ORIGINALS[fname] = orig
                setattr(dist, fname, _wrapper(fname, orig, spec))
            _OWNER.append(self)
            return True
        except Exception as exc:
            self._error("patch_collectives", exc)
            return False

    def unpatch_collectives(self) -> None:
        """Restore the original ``torch.distributed`` functions (if this tracer installed the wrappers)."""
        if not _OWNER or _OWNER[0] is not self:
            return
        dist = torch.distributed
        for fname, orig in _ORIGINALS.items():
            setattr(dist, fname, orig)
        _ORIGINALS.clear()
        _OWNER.clear()


def _wrapper(fname: str, orig: Callable[..., Any], spec: tuple[PhaseKind, str, str, str | bool]) -> Any:
    kind, tensor_arg, group_arg, async_arg = spec
    params = list(inspect.signature(orig).parameters)

    def pos(name: str) -> int:
        return params.index(name) if name in params else -1

    t_at, g_at = pos(tensor_arg), pos(group_arg) if group_arg else -1
    a_at = pos(async_arg) if isinstance(async_arg, str) else -1

    def arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str, default: Any) -> Any:
        if 0 <= at < len(args):
            return args[at]
        return kwargs.get(name, default)

    def timed(*args: Any, **kwargs: Any) -> Any:
        tracer = _OWNER[0] if _OWNER else None
        if tracer is None or tracer._cur is None or tracer._closed or inside_launch():
            return orig(*args, **kwargs)
        try:
            first = arg(args, kwargs, t_at, tensor_arg, None)
            if fname == "batch_isend_irecv":
                ops = list(first or ())
                first, group = (ops[0].tensor, ops[0].group) if ops else (None, None)
            else:
                group = arg(args, kwargs, g_at, group_arg, None) if group_arg else None
            async_op = bool(arg(args, kwargs, a_at, str(async_arg), False)) if a_at >= 0 else bool(async_arg)
            pgroup = tracer.group_kind(group)
            if pgroup is ParallelGroup.NONE and kind is PhaseKind.SEND_RECV:
                pgroup = ParallelGroup.PP
            name = default_name(kind, pgroup)
        except Exception as exc:
            tracer._error(f"patched {fname}", exc)
            return orig(*args, **kwargs)
        return tracer._timed_launch(name, kind, pgroup, first, group, async_op, lambda: orig(*args, **kwargs),
                                    proxy=True)

    timed.__name__ = timed.__qualname__ = fname
    timed.__doc__ = orig.__doc__
    timed.__wrapped__ = orig  # type: ignore[attr-defined]
    return timed
