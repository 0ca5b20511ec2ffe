"""On a real GPU: CUDA graph capture with the tracer active (nothing recorded inside the capture, replays timed,
CUPTI's graph ids on the replayed kernels), and argus stepping aside for a real torch.profiler session (the
profiler gets its kernels, argus's kernel records pause and resume). Skipped without CUDA (``scripts/gpu-check``
says so)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from argus.producers.cupti_kernels import CuptiState  # noqa: E402
from argus.schemas.records import KernelBatch, PauseReason, PhaseBatch, Step  # noqa: E402
from tests.gpu.test_tracer_gpu import Pub, busy, tracer  # noqa: E402


def test_graph_capture_and_replays(tmp_path: Path) -> None:
    pub = Pub()
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).cuda()
    x = torch.randn(256, 1024, device="cuda")
    with tracer(pub, tmp_path, kernels=True) as tr:
        tr.instrument(model)  # module hooks fire inside the capture: they must record nothing there
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs require before capture
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with tr.step(), torch.cuda.graph(graph):  # raises if a timing event is recorded on the capturing stream
            y = model(x)
        for _ in range(5):
            with tr.step():
                graph.replay()
        torch.cuda.synchronize()
        stats = tr.stats()
        cupti = tr.cupti_status
    assert y.shape == x.shape and stats.errors == 0 and stats.phases_captured >= 1
    replays = [b for b in pub.of(PhaseBatch) if "cuda-graph-0" in b.names]
    assert len(replays) == 5
    assert all(d > 0 for b in replays for n, d in zip(b.names, b.duration_ns, strict=True) if n == "cuda-graph-0")
    assert len(pub.of(Step)) == 6
    if cupti.state is not CuptiState.STOPPED:
        pytest.skip(f"CUPTI not running here: {cupti.reason}")
    batches = pub.of(KernelBatch)
    graph_kernels = sum(int(b.graph_launched.sum()) for b in batches)
    assert graph_kernels >= 5 * 2  # at least the two GEMMs of every replay, with their graph id
    ids = {int(g) for b in batches if len(b.graph_id) for g in b.graph_id if g}
    assert len(ids) == 1


def test_argus_steps_aside_for_a_torch_profiler_session(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    pub = Pub()
    with tracer(pub, tmp_path, kernels=True) as tr:
        if tr.cupti_status.state is not CuptiState.RUNNING:
            pytest.skip(f"CUPTI not running here: {tr.cupti_status.reason}")
        with tr.step():
            busy(2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            paused = (tr.cupti_status.state, tr._kernels.pause_reasons if tr._kernels else ())
            with tr.step():
                busy(2)
            torch.cuda.synchronize()
        resumed = tr.cupti_status.state
        with tr.step():
            busy(2)
        torch.cuda.synchronize()
        stats = tr.stats()
    assert paused == (CuptiState.PAUSED, (PauseReason.PROFILER,))
    assert resumed is CuptiState.RUNNING and stats.profiler_sessions == 1 and stats.kernel_pauses == 1
    gpu_events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    assert gpu_events, "the profiler got no kernels: CUPTI was not released to it"
    steps = {int(s) for b in pub.of(KernelBatch) for s in b.step}
    assert 0 in steps and 2 in steps  # kernel records before and after the session
    assert len(pub.of(Step)) == 3  # steps throughout
