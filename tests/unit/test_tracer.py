"""The rank-side tracer on CPU: host-clock steps and phases, hooks, gloo collectives, publication order and
counts, bounds, and the asynchronous event resolution with fake CUDA events."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from argus.core.settings import Settings  # noqa: E402
from argus.producers.cuda_timing import (  # noqa: E402
    EventPool,
    PhaseRec,
    StepRec,
    StepResolver,
    epoch_ns,
)
from argus.producers.rank_registry import RankRegistry  # noqa: E402
from argus.producers.tracer import Tracer  # noqa: E402
from argus.producers.tracer_collectives import CollectiveHandle, default_name  # noqa: E402
from argus.schemas.records import (  # noqa: E402
    JobLifecycle,
    JobTopology,
    KernelBatch,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    PhaseKind,
    Step,
)
from argus.topics import Topic, job_key, rank_key  # noqa: E402
from tests.samples import RecordingPublisher  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attention = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        return self.mlp(torch.relu(self.self_attention(x)))


def make(pub: RecordingPublisher, tmp_path: Path, **kw: Any) -> Tracer:
    kw.setdefault("registry", RankRegistry(tmp_path / "reg"))
    return Tracer(Settings(), "job-t", kw.pop("rank", 0), kw.pop("world_size", 1), pub, kernels=False, **kw)


def test_steps_and_phases_host_clock(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    with make(pub, tmp_path) as tr:
        for _ in range(3):
            with tr.step():
                with tr.phase("forward", PhaseKind.FORWARD):
                    time.sleep(0.002)
                    with tr.phase("inner", PhaseKind.OTHER):
                        pass
                with tr.phase("dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP):
                    time.sleep(0.001)
    steps, phases = pub.of(Step), pub.of(PhaseBatch)
    assert [s.step for s in steps] == [0, 1, 2] and [p.step for p in phases] == [0, 1, 2]
    for s, p in zip(steps, phases, strict=True):
        assert s.gpu_ns is None and s.wall_ns >= 3_000_000
        assert p.names == ("forward", "inner", "dp-allreduce")
        assert p.kinds == (PhaseKind.FORWARD, PhaseKind.OTHER, PhaseKind.ALL_REDUCE)
        assert p.groups == (ParallelGroup.NONE, ParallelGroup.NONE, ParallelGroup.DP)
        assert p.streams == (-1, -1, -1)
        assert p.duration_ns[0] >= 2_000_000 and p.duration_ns[2] >= 1_000_000
        assert s.start_ns <= p.start_ns[0] <= p.start_ns[1] <= p.start_ns[2] <= s.start_ns + s.wall_ns
        # Epoch ns, on the clock the stamps use: perf_counter from an anchor taken at import. Not against
        # time.time_ns(): a paused VM or a stepped wall clock moves that one later, not the stamps.
        assert abs(s.start_ns - epoch_ns(time.perf_counter_ns())) < 60 * 10**9
        assert s.start_ns > 1_500_000_000 * 10**9  # after 2017: epoch ns, not the perf counter's
    assert tr.stats().phases == 9


def test_publication_order_keys_and_end_counts(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    tr = make(pub, tmp_path).start()
    for _ in range(2):
        with tr.step():
            pass
    stats = tr.close()
    topics = [t for t, _, _ in pub.records]
    assert topics[:2] == [Topic.TOPOLOGY, Topic.LIFECYCLE]
    assert topics[-1] is Topic.LIFECYCLE and topics.count(Topic.STEPS) == 2 and topics.count(Topic.PHASES) == 2
    assert len(pub.records) - 1 in pub.flushed_at  # END published after a flush of everything before it
    assert all(k == job_key("job-t") for t, k, _ in pub.records if t is not Topic.KERNELS)
    topo = pub.of(JobTopology)[0]
    assert topo.world_size == 1 and topo.host == (socket.gethostname(),)
    start, end = pub.of(JobLifecycle)
    assert start.event is LifecycleEvent.START and end.event is LifecycleEvent.END
    assert (end.steps, end.phase_batches, end.kernel_events) == (2, 2, 0) and end.source == "live"
    assert stats.steps == stats.steps_published == 2 and stats.errors == 0
    assert tr.close() == tr.stats()  # idempotent


def test_non_lifecycle_rank_publishes_no_topology_and_unknown_counts(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    with make(pub, tmp_path, rank=1, world_size=2) as tr, tr.step():
        pass
    assert not pub.of(JobTopology) and not pub.of(JobLifecycle)
    pub0 = RecordingPublisher(check=True)
    with make(pub0, tmp_path, rank=0, world_size=2, dp=2) as tr0, tr0.step():
        pass
    end = pub0.of(JobLifecycle)[-1]
    assert end.steps is None and end.phase_batches is None  # no process group: totals unknown
    assert pub0.of(JobTopology)[0].dp_size == 2


def test_kernel_channel_ends_the_rank_stream_without_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    pub = RecordingPublisher(check=True)
    with Tracer(Settings(), "job-k", 0, 1, pub, registry=False) as tr, tr.step():
        pass
    assert tr.cupti_status.state.value in ("UNAVAILABLE", "DISABLED") and tr.cupti_status.reason
    (eos,) = pub.of(KernelBatch)
    assert eos.end_of_stream and len(eos) == 0
    kernel_keys = [k for t, k, _ in pub.records if t is Topic.KERNELS]
    assert kernel_keys == [rank_key("job-k", 0)]
    assert [t for t, _, _ in pub.records][-2:] == [Topic.KERNELS, Topic.LIFECYCLE]


def test_module_and_optimizer_hooks(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    model = torch.nn.Sequential(Block(), Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with make(pub, tmp_path) as tr:
        handles = tr.instrument(model, backward=True)
        assert len(handles) == 12  # per module: its forward wrapped, a backward pre/post hook pair
        assert "forward" in vars(model[0].mlp) and not model[0].mlp._forward_hooks  # no forward hooks
        tr.instrument_optimizer(opt)
        with tr.step():
            x = torch.randn(2, 8, requires_grad=True)
            loss = model(x).sum()
            loss.backward()
            opt.step()
    (batch,) = pub.of(PhaseBatch)
    fwd = [n for n, k in zip(batch.names, batch.kinds, strict=True) if k is PhaseKind.FORWARD]
    bwd = [n for n, k in zip(batch.names, batch.kinds, strict=True) if k is PhaseKind.BACKWARD]
    assert fwd == ["self_attention", "mlp", "self_attention", "mlp"]
    assert sorted(bwd) == ["mlp", "mlp", "self_attention", "self_attention"]
    assert batch.names[-1] == "optimizer" and batch.kinds[-1] is PhaseKind.OPTIMIZER
    # close() removed the hooks and the forward wrappers: a closed tracer records nothing more
    model(torch.randn(2, 8))
    assert len(pub.of(PhaseBatch)) == 1
    assert "forward" not in vars(model[0].mlp) and not model[0].mlp._backward_hooks


def test_a_wrapped_forward_that_raises_still_closes_its_phase(tmp_path: Path) -> None:
    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("inside the model")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Boom()

    pub = RecordingPublisher(check=True)
    net = Net()
    with make(pub, tmp_path) as tr:
        tr.instrument(net)
        with tr.step():
            with pytest.raises(ValueError, match="inside the model"):
                net.mlp(torch.ones(1))
            with tr.phase("after", PhaseKind.OTHER):
                pass
    (batch,) = pub.of(PhaseBatch)
    assert list(batch.names) == ["mlp", "after"]
    assert all(d >= 0 for d in batch.duration_ns)


def test_errors_never_reach_training(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    tr = make(pub, tmp_path, max_phases_per_step=2)
    with tr.phase("outside", PhaseKind.OTHER):  # no step: ignored, counted
        pass
    with pytest.raises(ZeroDivisionError), tr.step(), tr.phase("boom", PhaseKind.FORWARD):
        _ = 1 / 0
    with tr.step():
        for i in range(4):
            with tr.phase(f"p{i}", PhaseKind.OTHER):
                pass
    stats = tr.close()
    batches = pub.of(PhaseBatch)
    assert batches[0].names == ("boom",)  # the exception still closed the phase and the step
    assert batches[1].names == ("p0", "p1")
    assert stats.phases_dropped == 1 + 2 and stats.errors == 0


def test_dropping_publisher_is_counted(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True, accept=False)
    tr = make(pub, tmp_path)
    with tr.step():
        pass
    stats = tr.close()
    assert stats.steps_published == 0 and stats.publish_dropped == 2
    assert pub.of(JobLifecycle)[-1].steps == 0  # END announces only what was accepted


def test_rank_registry_entry_lives_with_the_tracer(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path / "reg")
    tr = make(RecordingPublisher(check=True), tmp_path, registry=reg, rank=0).start()
    entry = reg.lookup("job-t", 0)
    assert entry is not None and entry.alive() and entry.pid > 0
    tr.close()
    assert reg.lookup("job-t", 0) is None


@pytest.fixture
def gloo_group(tmp_path: Path) -> Any:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_collective_wrappers_under_gloo(tmp_path: Path, gloo_group: Any) -> None:
    pub = RecordingPublisher(check=True)
    t = torch.ones(4)
    with make(pub, tmp_path) as tr, tr.step():
        assert tr.all_reduce(t) is None
        handle = tr.all_reduce(t, parallel_group=ParallelGroup.TP, async_op=True)
        assert isinstance(handle, CollectiveHandle)
        handle.wait()
        out = torch.zeros(4)
        tr.all_gather_into_tensor(out, torch.full((4,), 2.0))
        tr.reduce_scatter_tensor(torch.zeros(4), torch.ones(4), name="grads-rs")
        tr.broadcast(t, src=0)
        with tr.collective("custom", PhaseKind.ALL_REDUCE, ParallelGroup.DP):
            dist.all_reduce(t)
    assert t.tolist() == [1.0] * 4 and out.tolist() == [2.0] * 4
    (batch,) = pub.of(PhaseBatch)
    assert batch.names == ("dp-allreduce", "tp-allreduce", "dp-all-gather", "grads-rs", "broadcast", "custom")
    assert batch.kinds[:3] == (PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE, PhaseKind.ALL_GATHER)
    assert batch.groups[1] is ParallelGroup.TP
    # with a process group, END carries the reduced totals
    assert pub.of(JobLifecycle)[-1].steps == 1


def test_collectives_outside_steps_and_after_close_still_run(tmp_path: Path, gloo_group: Any) -> None:
    tr = make(RecordingPublisher(check=True), tmp_path)
    t = torch.ones(2)
    tr.all_reduce(t)
    tr.close()
    h = tr.all_reduce(t, async_op=True)
    h.wait()
    assert t.tolist() == [1.0, 1.0]


def test_default_names() -> None:
    assert default_name(PhaseKind.ALL_REDUCE, ParallelGroup.DP) == "dp-allreduce"
    assert default_name(PhaseKind.SEND_RECV, ParallelGroup.PP) == "pp-send-recv"
    assert default_name(PhaseKind.ALL_GATHER, ParallelGroup.NONE) == "all-gather"


# -- asynchronous resolution with fake CUDA events ---------------------------------------------------------


class FakeEvent:
    """A CUDA event stand-in: completes when the test says so; elapsed_time from assigned GPU times (ms)."""

    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.t_ms = 0.0
        self.done = False
        self.synchronized = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.done and other.done, "elapsed_time before completion"
        return other.t_ms - self.t_ms

    def synchronize(self) -> None:  # pragma: no cover - must never be called
        self.synchronized = True
        raise AssertionError("the resolver must not synchronize")


def _ev(pool: EventPool, t_ms: float) -> FakeEvent:
    ev = pool.get()
    ev.t_ms = t_ms
    return ev


def test_resolver_waits_for_events_and_computes_gpu_times() -> None:
    pub = RecordingPublisher(check=True)
    pool = EventPool(FakeEvent, capacity=16)
    res = StepResolver("job-r", 1, pub, pool, poll_s=0.001)
    rec = StepRec(5, t0=1_000, ev0=_ev(pool, 10.0))
    compute = PhaseRec("forward", PhaseKind.FORWARD, ParallelGroup.NONE, 7, 1_100, _ev(pool, 10.5))
    compute.ev1 = _ev(pool, 12.5)
    comm = PhaseRec("dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP, 13, 1_200, _ev(pool, 12.0))
    comm.ev1 = _ev(pool, 15.0)  # on the NCCL side stream: ends after the compute stream's step end
    host = PhaseRec("data", PhaseKind.DATA_LOADER, ParallelGroup.NONE, -1, 1_050)
    host.t1 = 1_090
    rec.phases += [compute, comm, host]
    rec.ev1 = _ev(pool, 13.0)
    rec.t1 = 5_000_000
    res.submit(rec)
    time.sleep(0.05)
    assert not pub.records  # events not complete: nothing yet, and nobody synchronized
    for ev in rec.events():
        ev.done = True
    deadline = time.monotonic() + 5
    while len(pub.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    res.close()
    step, batch = pub.of(Step)[0], pub.of(PhaseBatch)[0]
    assert step.step == 5 and step.rank == 1 and step.wall_ns == 5_000_000 - 1_000
    assert step.gpu_ns == 5_000_000  # 10.0 ms .. 15.0 ms: the side-stream collective ends last
    assert batch.names == ("forward", "dp-allreduce", "data")
    assert batch.duration_ns == (2_000_000, 3_000_000, 40)
    assert batch.streams == (7, 13, -1)
    assert batch.start_ns[1] - step.start_ns == 2_000_000
    assert len(pool._free) == 6 and pool.alive == 6  # events went back to the pool


def test_resolver_bounds_and_unfinished_phases() -> None:
    pub = RecordingPublisher(check=True)
    res = StepResolver("job-b", 0, pub, None, max_pending=1)
    stuck_pool = EventPool(FakeEvent, capacity=4)
    blocked = StepRec(0, 1, ev0=_ev(stuck_pool, 0.0))
    blocked.ev1 = _ev(stuck_pool, 1.0)
    assert res.submit(blocked)
    assert not res.submit(StepRec(1, 1))  # queue full: dropped and counted
    for ev in blocked.events():
        ev.done = True
    time.sleep(0.05)
    open_phase = StepRec(2, 1)
    open_phase.phases.append(PhaseRec("never-closed", PhaseKind.OTHER, ParallelGroup.NONE, -1, 5))
    open_phase.t1 = 10
    res.submit(open_phase)
    res.close()
    assert res.steps_dropped == 1 and res.phases_dropped == 1
    assert [b.names for b in pub.of(PhaseBatch)] == [(), ()]


def test_event_pool_is_bounded() -> None:
    pool = EventPool(FakeEvent, capacity=2, prewarm=1)
    a, b = pool.get(), pool.get()
    assert a is not None and b is not None and pool.get() is None and pool.exhausted == 1
    pool.put([a])
    assert pool.get() is a


# -- CUDA-mode bookkeeping with a fake torch.cuda (no GPU here) -------------------------------------------


class FakeCuda:
    """Just enough of ``torch.cuda`` for the tracer: streams, a current stream, events with a fake GPU clock."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.default = FakeStream(self, 0, 7)
        self.current = self.default
        self.log: list[tuple[str, Any, Any]] = []
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.enable_timing, self.stream, self.t = enable_timing, None, None

            def record(self, stream: Any = None) -> None:
                cuda.clock += 1.0
                self.stream, self.t = stream or cuda.current, cuda.clock
                cuda.log.append(("record", self, self.stream))

            def query(self) -> bool:
                return self.t is not None

            def elapsed_time(self, other: Any) -> float:
                return float(other.t - self.t)

        self.Event = Event
        self._ids = 100

    def is_available(self) -> bool:
        return True

    def current_stream(self, device: Any = None) -> Any:
        return self.current

    def current_device(self) -> int:
        return 0

    def Stream(self, device: Any = None) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        self._ids += 1
        return FakeStream(self, self._ids * 1000, self._ids)

    def stream(self, s: Any) -> Any:
        cuda = self

        class Ctx:
            def __enter__(self) -> None:
                self.prev, cuda.current = cuda.current, s

            def __exit__(self, *exc: object) -> None:
                cuda.current = self.prev

        return Ctx()


class FakeStream:
    def __init__(self, cuda: FakeCuda, ptr: int, sid: int) -> None:
        self.cuda, self.cuda_stream, self.stream_id, self.device = cuda, ptr, sid, torch.device("cpu")

    def wait_stream(self, other: Any) -> None:
        self.cuda.log.append(("wait", self, other))

    def query(self) -> bool:
        return True


class FakeTorch:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.device, self.distributed, self.tensor = cuda, torch.device, dist, torch.tensor


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    import argus.producers.tracer as tracer_mod
    import argus.producers.tracer_collectives as coll_mod

    cuda = FakeCuda()
    monkeypatch.setattr(tracer_mod, "torch", FakeTorch(cuda))
    monkeypatch.setattr(coll_mod, "torch", FakeTorch(cuda))
    return cuda


def test_cuda_phases_record_events_on_their_stream(tmp_path: Path, fake_cuda: FakeCuda) -> None:
    pub = RecordingPublisher(check=True)
    side = fake_cuda.Stream()
    with make(pub, tmp_path, cuda=True) as tr:
        assert tr.stats().cuda
        with tr.step():
            with tr.phase("forward", PhaseKind.FORWARD):
                pass
            with tr.collective("dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP, stream=side):
                fake_cuda.clock += 10  # the collective's time on the side stream
    (batch,), (step,) = pub.of(PhaseBatch), pub.of(Step)
    assert batch.streams == (7, side.stream_id)
    assert batch.duration_ns == (1_000_000, 11_000_000)  # fake clock: 1 "ms" per record
    assert step.gpu_ns == 15_000_000  # step events at 1 and 16 on the fake clock
    records = [(e.enable_timing, s) for kind, e, s in fake_cuda.log if kind == "record"]
    assert records[1:3] == [(True, fake_cuda.default), (True, fake_cuda.default)]  # forward: current stream
    assert records[3:5] == [(True, side), (True, side)]  # the collective: both events on its own stream


class FakeWork:
    def __init__(self, cuda: FakeCuda, took: float) -> None:
        self.cuda, self.took, self.waited_on = cuda, took, None

    def wait(self) -> None:
        self.waited_on = self.cuda.current  # NCCL: the *current* stream waits for the collective
        self.cuda.clock += self.took
        self.cuda.log.append(("work.wait", self, self.cuda.current))


class FakeCudaTensor:
    is_cuda = True
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.used_on: list[Any] = []

    def record_stream(self, s: Any) -> None:
        self.used_on.append(s)


def test_collective_wrapper_times_on_a_communication_stream(tmp_path: Path, fake_cuda: FakeCuda) -> None:
    pub = RecordingPublisher(check=True)
    t = FakeCudaTensor()
    works: list[FakeWork] = []

    def launch() -> FakeWork:
        works.append(FakeWork(fake_cuda, 20))
        return works[-1]

    with make(pub, tmp_path, cuda=True) as tr, tr.step():
        assert tr._collective(None, PhaseKind.ALL_REDUCE, ParallelGroup.DP, (t,), None, False, launch) is None
        handle = tr._collective(None, PhaseKind.ALL_REDUCE, ParallelGroup.DP, (t,), None, True, launch)
        assert isinstance(handle, CollectiveHandle)
        handle.wait()
    comm = works[0].waited_on
    assert comm is not fake_cuda.default and works[1].waited_on is comm  # one stream per (device, group)
    waits = [(a, b) for kind, a, b in fake_cuda.log if kind == "wait"]
    assert waits[0] == (comm, fake_cuda.default)  # comm waits for the compute stream before the collective
    assert waits[1] == (fake_cuda.default, comm)  # sync: compute waits for comm afterwards
    assert waits[3] == (fake_cuda.default, comm)  # async: at handle.wait()
    assert t.used_on == [comm]  # async: the tensor is marked as used on comm for the allocator
    (batch,) = pub.of(PhaseBatch)
    assert batch.names == ("dp-allreduce", "dp-allreduce")
    assert batch.streams == (comm.stream_id, comm.stream_id)
    assert all(d >= 20_000_000 for d in batch.duration_ns)  # the 20 "ms" of the collective are inside


def test_expert_tokens_are_counted_per_step_and_sent_with_it(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    with make(pub, tmp_path) as tr:
        tr.count_expert_tokens(5)  # outside a step: ignored
        with tr.step():
            for n in (100, 40, 2):
                tr.count_expert_tokens(n)
            tr.count_expert_tokens(-1)  # refused, never raised into training
            tr.count_expert_tokens(3.5)  # type: ignore[arg-type]
        with tr.step():
            pass
    assert [s.expert_tokens for s in pub.of(Step)] == [142, None]
    assert tr.stats().errors >= 2
