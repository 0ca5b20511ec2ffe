"""``torch.distributed`` collective wrappers of the :class:`~argus.producers.tracer.Tracer` (a mixin).

Each wrapper launches the collective with ``async_op=True`` and times it as a communication phase:
see docs/internals/producers.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from argus.producers.cuda_timing import EventPool, PhaseOpener, StepRec
from argus.producers.gpu_ids import gpu_id
from argus.producers.heartbeat import LiveState
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology, ParallelGroup, PhaseKind

try:
    import torch as _torch
except ImportError:  # pragma: no cover
    _torch = None  # type: ignore[assignment]
torch: Any = _torch

__all__ = ["CollectiveHandle", "CollectiveMixin", "default_name", "guarded", "inside_launch"]

_perf = time.perf_counter_ns
_local = threading.local()


def inside_launch() -> bool:
    """Whether this thread is inside a collective launched by a tracer wrapper (the ``torch.distributed``
    patch of :mod:`argus.producers.tracer_patch` then does not time it again)."""
    return getattr(_local, "depth", 0) > 0


def guarded(launch: Callable[[], Any]) -> Any:
    """Run ``launch`` marked as a tracer launch (see :func:`inside_launch`); returns its result."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return launch()
    finally:
        _local.depth -= 1

_SUFFIX = {
    PhaseKind.ALL_REDUCE: "allreduce", PhaseKind.REDUCE_SCATTER: "reduce-scatter",
    PhaseKind.ALL_GATHER: "all-gather", PhaseKind.BROADCAST: "broadcast", PhaseKind.ALL_TO_ALL: "all-to-all",
    PhaseKind.SEND_RECV: "send-recv",
}


def default_name(kind: PhaseKind, group: ParallelGroup) -> str:
    """``dp-allreduce``, ``tp-allreduce``, ``dp-reduce-scatter``, ``pp-send-recv``, ... (``allreduce`` for NONE)."""
    suffix = _SUFFIX.get(kind, kind.value.lower())
    return suffix if group is ParallelGroup.NONE else f"{group.value.lower()}-{suffix}"


def _wait(work: Any) -> None:
    if work is None:
        return
    if isinstance(work, (list, tuple)):
        for w in work:
            w.wait()
    else:
        work.wait()


class CollectiveHandle:
    """An async collective started by a tracer wrapper. ``wait()`` makes the caller's current CUDA stream wait
    for it (CUDA) or blocks until it is done (host), then ends its phase (host timing)."""

    def __init__(self, work: Any, comm_stream: Any = None, on_done: Callable[[], None] | None = None) -> None:
        self.work = work
        self._comm = comm_stream
        self._on_done = on_done
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if self._done:
            return True
        if self._comm is not None:
            torch.cuda.current_stream(self._comm.device).wait_stream(self._comm)
        else:
            _wait(self.work)
        self._done = True
        if self._on_done is not None:
            self._on_done()
        return True

    def is_completed(self) -> bool:
        if self._comm is not None:
            return bool(self._comm.query())
        works = self.work if isinstance(self.work, (list, tuple)) else [self.work]
        return all(w is None or w.is_completed() for w in works)


class CollectiveMixin(PhaseOpener):
    """The collective wrappers; mixed into :class:`~argus.producers.tracer.Tracer`, which provides the state."""

    _pool: EventPool | None
    _cur: StepRec | None
    _closed: bool
    _comm_streams: dict[tuple[int, int], Any]
    _live: LiveState
    job_id: str
    world_size: int
    host: str
    _reduce_counts: bool
    _dims: tuple[int | None, int, int, int]

    # -- wrappers ------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, *,
                   parallel_group: ParallelGroup = ParallelGroup.DP, name: str | None = None,
                   async_op: bool = False) -> Any:
        """``torch.distributed.all_reduce`` timed as an ALL_REDUCE phase (default name ``dp-allreduce``)."""
        dist = torch.distributed
        red = dist.ReduceOp.SUM if op is None else op
        return self._collective(name, PhaseKind.ALL_REDUCE, parallel_group, (tensor,), group, async_op,
                                lambda: dist.all_reduce(tensor, op=red, group=group, async_op=True))

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any = None, group: Any = None, *,
                              parallel_group: ParallelGroup = ParallelGroup.DP, name: str | None = None,
                              async_op: bool = False) -> Any:
        """``torch.distributed.reduce_scatter_tensor`` timed as a REDUCE_SCATTER phase."""
        dist = torch.distributed
        red = dist.ReduceOp.SUM if op is None else op
        return self._collective(name, PhaseKind.REDUCE_SCATTER, parallel_group, (output, input), group, async_op,
                                lambda: dist.reduce_scatter_tensor(output, input, op=red, group=group, async_op=True))

    def all_gather_into_tensor(self, output: Any, input: Any, group: Any = None, *,
                               parallel_group: ParallelGroup = ParallelGroup.DP, name: str | None = None,
                               async_op: bool = False) -> Any:
        """``torch.distributed.all_gather_into_tensor`` timed as an ALL_GATHER phase."""
        dist = torch.distributed
        return self._collective(name, PhaseKind.ALL_GATHER, parallel_group, (output, input), group, async_op,
                                lambda: dist.all_gather_into_tensor(output, input, group=group, async_op=True))

    def broadcast(self, tensor: Any, src: int, group: Any = None, *,
                  parallel_group: ParallelGroup = ParallelGroup.NONE, name: str | None = None,
                  async_op: bool = False) -> Any:
        """``torch.distributed.broadcast`` timed as a BROADCAST phase."""
        dist = torch.distributed
        return self._collective(name, PhaseKind.BROADCAST, parallel_group, (tensor,), group, async_op,
                                lambda: dist.broadcast(tensor, src, group=group, async_op=True))

    def all_to_all_single(self, output: Any, input: Any, group: Any = None, *,
                          parallel_group: ParallelGroup = ParallelGroup.EP, name: str | None = None,
                          async_op: bool = False) -> Any:
        """``torch.distributed.all_to_all_single`` timed as an ALL_TO_ALL phase."""
        dist = torch.distributed
        return self._collective(name, PhaseKind.ALL_TO_ALL, parallel_group, (output, input), group, async_op,
                                lambda: dist.all_to_all_single(output, input, group=group, async_op=True))

    def batch_isend_irecv(self, p2p_ops: Sequence[Any], *, parallel_group: ParallelGroup = ParallelGroup.PP,
                          name: str | None = None, async_op: bool = False) -> Any:
        """``torch.distributed.batch_isend_irecv`` timed as a SEND_RECV phase (default ``pp-send-recv``)."""
        dist = torch.distributed
        tensors = tuple(op.tensor for op in p2p_ops)
        group = getattr(p2p_ops[0], "group", None) if p2p_ops else None
        return self._collective(name, PhaseKind.SEND_RECV, parallel_group, tensors, group, async_op,
                                lambda: dist.batch_isend_irecv(list(p2p_ops)))

    # -- the timing ------------------------------------------------------------------------------------------

    def _collective(self, name: str | None, kind: PhaseKind, pgroup: ParallelGroup, tensors: Sequence[Any],
                    group: Any, async_op: bool, launch: Callable[[], Any]) -> Any:
        label = name or default_name(kind, pgroup)
        first: Any = tensors[0] if tensors else None
        raw = launch

        def marked() -> Any:  # a patched torch.distributed function inside does not time it again
            return guarded(raw)

        launch = marked
        if self._closed or self._capturing():  # captured into a CUDA graph: timed by its replays, not here
            return self._plain(launch, async_op)
        live = self._live
        # In flight from here until done (heartbeats): kind, group and this rank's sequence number in it.
        live.issue(kind, pgroup, _perf())
        if self._pool is not None and self._cur is not None and bool(getattr(first, "is_cuda", False)):
            try:
                cur = torch.cuda.current_stream(first.device)
                comm = self._comm_stream(first.device, group)
                comm.wait_stream(cur)
            except Exception as exc:
                self._error(f"collective {label} stream setup", exc)
                return self._plain(launch, async_op)
            with torch.cuda.stream(comm):
                rec = self._open(label, kind, pgroup, comm)
                work = launch()
                live.coll_work = work  # the host does not wait: in flight until the work completes
                _wait(work)  # device-side: the communication stream waits for the collective
                if rec is not None:
                    self._close(rec)
            try:
                if async_op:
                    for t in tensors:
                        t.record_stream(comm)
                    return CollectiveHandle(work, comm_stream=comm)
                cur.wait_stream(comm)
            except Exception as exc:
                self._error(f"collective {label} ordering", exc)
                torch.cuda.current_stream(first.device).wait_stream(comm)
                return CollectiveHandle(work, comm_stream=comm) if async_op else None
            return None
        rec = self._open(label, kind, pgroup, None, host=True)
        work = launch()
        seq = live.coll_seq
        if async_op:
            def on_done() -> None:
                if rec is not None:
                    self._close(rec)
                live.done(pgroup, seq)
            return CollectiveHandle(work, on_done=on_done)
        _wait(work)
        if rec is not None:
            self._close(rec)
        live.done(pgroup, seq)
        return None

    @staticmethod
    def _plain(launch: Callable[[], Any], async_op: bool) -> Any:
        work = launch()
        if async_op:
            return CollectiveHandle(work)
        _wait(work)
        return None

    def _comm_stream(self, device: Any, group: Any) -> Any:
        dev = torch.device(device)
        key = (dev.index if dev.index is not None else torch.cuda.current_device(), 0 if group is None else id(group))
        s = self._comm_streams.get(key)
        if s is None:
            s = self._comm_streams[key] = torch.cuda.Stream(device=dev)
        return s

    # -- torch.distributed helpers of the tracer --------------------------------------------------------------

    def _dist(self) -> Any:
        if torch is None:
            return None
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() != self.world_size:
            return None
        return dist

    def _gather_hosts(self) -> list[tuple[str, str]] | None:
        """Every rank's (host, GPU id) by rank (:func:`~argus.producers.gpu_ids.gpu_id`; '' unknown)."""
        dist = self._dist()
        if dist is None:
            return None
        try:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, (self.host, gpu_id()))
            return [(str(h[0]), str(h[1])) if isinstance(h, (tuple, list)) and len(h) == 2 else (str(h), "")
                    for h in out]
        except Exception as exc:
            self._error("host gather", exc)
            return None

    def _sum_over_ranks(self, local: list[int]) -> list[int] | None:
        """``local`` summed over all ranks with one ``all_reduce`` (None without a matching process group,
        when ``reduce_counts`` is off, or on failure)."""
        if self.world_size == 1:
            return list(local)
        dist = self._dist() if self._reduce_counts else None
        if dist is None:
            return None
        try:
            device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
            t = torch.tensor(local, dtype=torch.int64, device=device)
            dist.all_reduce(t)
            return [int(v) for v in t.tolist()]
        except Exception as exc:
            self._error("count all_reduce", exc)
            return None

    def _build_topology(self) -> JobTopology:
        dp, tp, pp, ep = self._dims
        if dp is None:
            dp = max(1, self.world_size // (tp * pp))
        topo = build_topology(self.job_id, dp, tp, pp, ep, hosts_per_node=max(1, self.world_size))
        hosts = self._gather_hosts()
        if hosts is None and self.world_size == 1:
            hosts = [(self.host, gpu_id())]
        if hosts is not None and len(hosts) == topo.world_size:
            gpus = tuple(g for _, g in hosts)
            topo = JobTopology(topo.job_id, topo.world_size, topo.dp_size, topo.tp_size, topo.pp_size, topo.rank,
                               tuple(h for h, _ in hosts), topo.dp_group, topo.tp_group, topo.pp_group,
                               topo.ep_group, topo.pp_stage, topo.ep_size, gpu=gpus if any(gpus) else ())
        return topo
