"""The tracer on a real GPU: events on the collective's own stream, no synchronize on the training thread,
and CUPTI kernel batches whose stream ids match the phases'. Skipped without CUDA."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from argus.core.settings import Settings  # noqa: E402
from argus.producers.cupti_kernels import CuptiState  # noqa: E402
from argus.producers.tracer import Tracer  # noqa: E402
from argus.schemas.records import KernelBatch, ParallelGroup, PhaseBatch, PhaseKind, Step  # noqa: E402
from argus.topics import Topic  # noqa: E402


class Pub:
    def __init__(self) -> None:
        self.records: list[tuple[Topic, Any]] = []
        self.lock = threading.Lock()

    def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
        record.encode()
        with self.lock:
            self.records.append((topic, record))
        return True

    def flush(self, timeout_s: float = 30.0) -> int:
        return 0

    def of(self, cls: type) -> list[Any]:
        return [r for _, r in self.records if isinstance(r, cls)]


_MS_PER_MATMUL: list[float] = []


def busy(ms: float, stream: Any = None) -> None:
    """Queue about ``ms`` of GPU work (a chain of matmuls) on ``stream``; calibrated once, on first use."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    if not _MS_PER_MATMUL:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            a @ a
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        _MS_PER_MATMUL.append(max(start.elapsed_time(end) / 10, 1e-3))
    reps = max(1, int(ms / _MS_PER_MATMUL[0]))
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        for _ in range(reps):
            a = (a @ a).clamp_(-1, 1)


def tracer(pub: Pub, tmp_path: Path, **kw: Any) -> Tracer:
    return Tracer(Settings(), "gpu-job", 0, 1, pub, registry=False, **kw)


def test_side_stream_phase_is_timed_on_its_stream(tmp_path: Path) -> None:
    pub = Pub()
    side = torch.cuda.Stream()
    with tracer(pub, tmp_path, kernels=False) as tr, tr.step():
        with tr.collective("dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP, stream=side):
            busy(20, side)
        with tr.phase("wrong-stream", PhaseKind.ALL_REDUCE):  # events on the compute stream: near-instant
            busy(20, side)
        with tr.phase("forward", PhaseKind.FORWARD):
            busy(5)
    (batch,) = pub.of(PhaseBatch)
    (step,) = pub.of(Step)
    dur = dict(zip(batch.names, batch.duration_ns, strict=True))
    streams = dict(zip(batch.names, batch.streams, strict=True))
    assert dur["dp-allreduce"] > 10_000_000  # the 20 ms on the side stream
    assert dur["wrong-stream"] < 2_000_000  # what the paper warns about
    assert streams["dp-allreduce"] != streams["forward"] and streams["forward"] == streams["wrong-stream"]
    assert step.gpu_ns is not None and step.gpu_ns >= dur["dp-allreduce"]


def test_training_thread_never_synchronizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    main = threading.get_ident()
    calls: list[str] = []
    real_sync, real_ev_sync = torch.cuda.synchronize, torch.cuda.Event.synchronize

    def sync(*a: Any, **k: Any) -> Any:
        if threading.get_ident() == main:
            calls.append("synchronize")
        return real_sync(*a, **k)

    def ev_sync(self: Any) -> Any:
        if threading.get_ident() == main:
            calls.append("event.synchronize")
        return real_ev_sync(self)

    busy(1)  # calibrates (synchronizing) before the check
    pub = Pub()
    tr = tracer(pub, tmp_path, kernels=False).start()
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", ev_sync)
    t0 = time.perf_counter()
    for _ in range(5):
        with tr.step(), tr.phase("forward", PhaseKind.FORWARD):
            busy(10)
    host_s = time.perf_counter() - t0
    monkeypatch.undo()
    tr.close()
    assert calls == []
    assert len(pub.of(Step)) == 5 and all(s.gpu_ns and s.gpu_ns > 5_000_000 for s in pub.of(Step))
    assert host_s < 5.0


def test_all_reduce_wrapper_uses_a_communication_stream(tmp_path: Path) -> None:
    dist = torch.distributed
    if not dist.is_nccl_available():
        pytest.skip("NCCL not available")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        pub = Pub()
        t = torch.ones(1 << 20, device="cuda")
        with tracer(pub, tmp_path, kernels=False) as tr, tr.step():
            with tr.phase("forward", PhaseKind.FORWARD):
                busy(5)
            h = tr.all_reduce(t, async_op=True)
            busy(5)  # overlaps with the collective
            h.wait()
            tr.all_reduce(t)
        (batch,) = pub.of(PhaseBatch)
        assert batch.names == ("forward", "dp-allreduce", "dp-allreduce")
        assert batch.streams[1] != batch.streams[0] and batch.streams[1] == batch.streams[2]
        assert torch.equal(t, torch.ones_like(t))
    finally:
        dist.destroy_process_group()


def test_cupti_kernel_batches(tmp_path: Path) -> None:
    pub = Pub()
    side = torch.cuda.Stream()
    with tracer(pub, tmp_path, kernels=True) as tr:
        if tr.cupti_status.state is not CuptiState.RUNNING:
            pytest.skip(f"CUPTI not running here: {tr.cupti_status.reason}")
        for _ in range(3):
            with tr.step():
                with tr.phase("forward", PhaseKind.FORWARD):
                    busy(2)
                with tr.collective("side", PhaseKind.OTHER, stream=side):
                    busy(2, side)
                x = torch.ones(1000, device="cuda")
                x.cpu()  # a memcpy DtoH
    batches = pub.of(KernelBatch)
    assert batches and batches[-1].end_of_stream
    assert [b.seq for b in batches] == list(range(len(batches)))
    events = sum(len(b) for b in batches)
    assert events > 10 and tr.stats().kernel_events == events
    names = {n for b in batches for n in b.names}
    assert "memcpy:DtoH" in names
    assert not any(n.endswith(")") for n in names)  # parameter lists are stripped by normalization
    steps = {int(s) for b in batches for s in b.step}
    assert {0, 1, 2} <= steps
    kernel_streams = {int(s) for b in batches for s in b.stream}
    phase_streams = {s for p in pub.of(PhaseBatch) for s in p.streams}
    assert phase_streams <= kernel_streams  # phase stream ids are CUPTI's, as on kernel events
