"""Benchmark: what the rank-side producers cost, per kernel record and per phase.

* Kernel records (CUPTI path). The training thread pays nothing per kernel: CUPTI records kernels in the
  driver and hands full buffers to its own worker thread, where the argus callback only appends the buffer
  to a queue (measured: ``ns_per_kernel_record_callback``). The real work is the parser thread's: activity
  records -> columns -> KernelBatches with per-batch name dictionaries and normalized names. That is
  ``ns_per_kernel_record`` (budget 1,000 ns), measured on real ``cupti-python`` record objects when the
  package imports (else attribute-compatible stand-ins), 50 distinct kernel names, batches of 4,096.
  ``ns_per_kernel_record_encode`` adds the Avro encoding the publisher's sender thread does (reported only).
* Phases: the median over many repetitions of ``with tracer.phase(...)`` inside a step, host-clock mode
  (``ns_per_phase``, budget 5,000 ns) and, when CUDA is available, with CUDA timing events
  (``ns_per_phase_cuda``, reported). ``ns_per_step`` is an empty ``with tracer.step()`` (host clock).
* Heartbeat bookkeeping: what the training thread's writes to the heartbeat state add to a phase
  (``ns_per_phase_heartbeat``, budget 1,000 ns): the median over interleaved rounds of the per-phase cost
  with heartbeats on minus with them off (the heartbeat thread itself runs beside, at 0.05 s); and
  ``ns_per_phase_heartbeat_state``, the state writes alone (``LiveState.enter`` + ``exit``, reported).
* Hooks of ``argus.attach`` (what a script pays without code changes), each the median over interleaved rounds
  of the same loop with and without the instrumentation, inside a step, host clock:
  ``ns_per_module_call`` (budget 2,000 ns): one call of a module timed as a phase
  (``instrument(model, modules=...)``, which wraps the module's ``forward``) minus the same call untimed, and
  ``ns_per_module_call_torch_dispatch`` (reported): what a no-op forward pre/post hook pair alone would cost
  (any hook sends every call through torch's slow hook dispatch: why the forward is wrapped instead);
  ``ns_per_ddp_bucket`` (budget 5,000 ns): the argus DDP communication hook around a bucket (phase, heartbeat
  state, the future's ``then``) minus calling the chained hook directly (a hook that returns a completed
  future, so the collective's own cost is out); ``ns_per_model_step`` (reported): the whole-model hooks of
  one forward + backward (FORWARD and BACKWARD phases, the output's grad hook, the end-of-backward callback).

Prints one JSON line; exits 1 if a budget is missed.
Run: .venv/bin/python load_tests/producer_overhead.py [--records 200000] [--phases 200000]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from argus.core.settings import Settings  # noqa: E402
from argus.producers.cupti_kernels import CuptiKernels  # noqa: E402
from argus.producers.cupti_parse import (  # noqa: E402
    KIND_CONCURRENT_KERNEL,
    KIND_MEMCPY,
    NameTable,
    columns_to_batches,
    extract_columns,
)
from argus.schemas.records import ParallelGroup, PhaseKind  # noqa: E402
from argus.topics import Topic  # noqa: E402

BUDGET_NS_PER_KERNEL_RECORD = 1_000
BUDGET_NS_PER_PHASE = 5_000
BUDGET_NS_PER_PHASE_HEARTBEAT = 1_000
BUDGET_NS_PER_MODULE_CALL = 2_000
BUDGET_NS_PER_DDP_BUCKET = 5_000

NAMES = (
    [f"void at::native::vectorized_elementwise_kernel<4, at::native::Functor{i}<float>, at::detail::Array<char*, 2> >"
     f"(int, at::native::Functor{i}<float>, at::detail::Array<char*, 2>)" for i in range(20)]
    + [f"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize{64 * (1 + i % 4)}x128x64_warpgroupsize1x1x1_kernel{i}"
       for i in range(20)]
    + ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
       "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
       "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"]
    + [f"triton_poi_fused_add_mul_{i}" for i in range(7)]
)


class NullPublisher:
    def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
        return True

    def flush(self, timeout_s: float = 30.0) -> int:
        return 0


_SHARED_NAMES: dict[str, Any] = {}  # C strings the fake records point at (kept alive for the whole run)


def _record_factories() -> tuple[Any, Any, Any, str]:
    """Constructors of kernel and memcpy records, and a function that sets a kernel's name."""
    try:
        import ctypes

        from cupti import cupti

        offset = cupti.activity_kernel11_dtype.fields["name"][1]
        # CUPTI's records of one kernel all point at one name string that CUPTI owns: mimic that.
        shared = _SHARED_NAMES or _SHARED_NAMES.update(
            {name: ctypes.create_string_buffer(name.encode()) for name in NAMES}) or _SHARED_NAMES

        def set_name(r: Any, name: str) -> None:
            ctypes.c_uint64.from_address(r.ptr + offset).value = ctypes.addressof(shared[name])

        return cupti.ActivityKernel11, cupti.ActivityMemcpy6, set_name, "cupti-python ActivityKernel11/Memcpy6"
    except Exception:
        return SimpleNamespace, SimpleNamespace, lambda r, name: setattr(r, "name", name), "SimpleNamespace"


def make_records(n: int, t: int = 1_000_000_000) -> tuple[list[Any], str]:
    """``n`` kernel/memcpy activity records: real cupti-python objects when available."""
    kernel, copy, set_name, kind = _record_factories()
    out = []
    for i in range(n):
        if i % 25 == 24:
            r = copy()
            r.kind, r.copy_kind = KIND_MEMCPY, 1 + i % 2
        else:
            r = kernel()
            r.kind = KIND_CONCURRENT_KERNEL
            set_name(r, NAMES[(i * 7) % len(NAMES)])
        r.start, r.end, r.stream_id, r.correlation_id = t, t + 1_000 + i % 97, 7 + i % 3, i
        t += 1_500
        out.append(r)
    return out, kind


BUFFER_RECORDS = 9_362  # records (224 bytes each) of one 2 MiB CUPTI buffer (CuptiKernels default)


def bench_kernels(n: int, repeats: int = 5) -> dict[str, Any]:
    """Parser cost per record, buffer by buffer: each buffer's records are created just before it is parsed,
    as CUPTI's completed callback creates them just before the parser thread takes the buffer."""
    per_record, per_encode = [], []
    kind = ""
    for _ in range(repeats):
        names = NameTable()  # a fresh parser: its name cache starts empty, as after a restart
        parse_ns = encode_ns = events = 0
        for lo in range(0, n, BUFFER_RECORDS):
            buffer, kind = make_records(min(BUFFER_RECORDS, n - lo), t=1_000_000_000 + lo * 1_500)
            t0 = time.perf_counter_ns()
            cols = extract_columns(buffer, names, clock_offset_ns=123)
            batches, _ = columns_to_batches(cols, names, job_id="bench", rank=0, batch_events=4096, final=True)
            t1 = time.perf_counter_ns()
            for b in batches:
                b.encode()
            encode_ns += time.perf_counter_ns() - t1
            parse_ns += t1 - t0
            events += sum(len(b) for b in batches)
        per_record.append(parse_ns / n)
        per_encode.append(encode_ns / max(1, events))
    buffers = [make_records(BUFFER_RECORDS)[0] for _ in range(4)]
    kernels = CuptiKernels("bench", 0, 1, NullPublisher(), env={"ARGUS_CUPTI": "0"},
                           max_queued_records=10 * BUFFER_RECORDS)
    t0 = time.perf_counter_ns()
    for buf in buffers:
        kernels._buffer_completed(buf)
    callback = (time.perf_counter_ns() - t0) / (4 * BUFFER_RECORDS)
    return {"ns_per_kernel_record": round(statistics.median(per_record), 1),
            "ns_per_kernel_record_encode": round(statistics.median(per_encode), 1),
            "ns_per_kernel_record_callback": round(callback, 3), "kernel_record_type": kind,
            "kernel_records": n}


def bench_phases(n: int, cuda: bool, heartbeat: bool = True, interval_s: float = 2.0) -> dict[str, float]:
    from argus.producers.tracer import Tracer

    tracer = Tracer(Settings(heartbeat_interval_s=interval_s), "bench", 0, 1, NullPublisher(), kernels=False,
                    cuda=cuda, registry=False, lifecycle=False, max_pending_steps=1 << 20, heartbeat=heartbeat)
    tracer.start()
    per_batch = 100  # phases per step
    samples = []
    phase, kind = tracer.phase, PhaseKind.FORWARD
    perf = time.perf_counter_ns
    for _ in range(max(1, n // per_batch)):
        with tracer.step():
            t0 = perf()
            for _ in range(per_batch):
                with phase("forward", kind):
                    pass
            samples.append((perf() - t0) / per_batch)
        if cuda and tracer._resolver.pending > 64:  # let the resolver keep up, as a real step's length would
            while tracer._resolver.pending > 8:
                time.sleep(0.001)
    steps = []
    for _ in range(2_000):
        t0 = perf()
        with tracer.step():
            pass
        steps.append(perf() - t0)
    tracer.close(timeout_s=5)
    return {"phase": statistics.median(samples), "step": statistics.median(steps)}


def bench_heartbeat(n: int, rounds: int = 7) -> float:
    """ns per phase added by the heartbeat bookkeeping: median over interleaved on/off rounds (so drift of
    the machine hits both alike) of the difference of their per-phase medians."""
    diffs = []
    for _ in range(rounds):
        on = bench_phases(n, cuda=False, heartbeat=True, interval_s=0.05)["phase"]
        off = bench_phases(n, cuda=False, heartbeat=False)["phase"]
        diffs.append(on - off)
    return statistics.median(diffs)


def bench_live_state(n: int = 200_000) -> float:
    """ns of the two heartbeat-state writes a phase makes (``enter`` + ``exit``), minus an empty loop: the
    same bookkeeping as :func:`bench_heartbeat` without the tracer's noise around it."""
    from argus.producers.cuda_timing import PhaseRec
    from argus.producers.heartbeat import LiveState

    st, rec = LiveState(), PhaseRec("forward", PhaseKind.FORWARD, ParallelGroup.NONE, -1, 0)
    enter, leave, perf = st.enter, st.exit, time.perf_counter_ns
    best = []
    for _ in range(5):
        t0 = perf()
        for _ in range(n):
            enter(rec)
            leave(rec)
        t1 = perf()
        for _ in range(n):
            pass
        best.append((t1 - t0 - (perf() - t1)) / n)
    return min(best)


def _bench_tracer() -> Any:
    from argus.producers.tracer import Tracer

    return Tracer(Settings(), "bench", 0, 1, NullPublisher(), kernels=False, cuda=False, registry=False,
                  lifecycle=False, max_pending_steps=1 << 20, heartbeat=False).start()


def _drained(tracer: Any) -> None:
    """Wait until the resolver thread published every step: its work (building PhaseBatches) would otherwise
    compete with the next measurement for the GIL and be counted as hook cost."""
    deadline = time.monotonic() + 5
    while tracer._resolver.pending and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(0.001)


def _interleaved(hooked: Any, plain: Any, rounds: int) -> float:
    """Median over rounds of (per-call ns of ``hooked``) - (per-call ns of ``plain``), run alternately; each
    is the fastest of a few chunks of calls (a busy machine's preemptions only ever add time)."""
    diffs = []
    for _ in range(rounds):
        diffs.append(min(hooked() for _ in range(4)) - min(plain() for _ in range(4)))
    return statistics.median(diffs)


def _ns_per_call(tracer: Any, call: Any, per: int) -> float:
    """ns per ``call()`` over ``per`` calls inside one step of ``tracer`` (its queue drained first)."""
    _drained(tracer)
    perf = time.perf_counter_ns
    with tracer.step():
        t0 = perf()
        for _ in range(per):
            call()
        return (perf() - t0) / per


def bench_module_hooks(n: int, rounds: int = 15) -> tuple[float, float]:
    """ns one module call costs with the tracer's forward pre/post hooks (see the module docstring), and what
    torch's hook dispatch alone costs (a no-op pre/post hook pair)."""
    import torch

    class Leaf(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Leaf()

    tracer = _bench_tracer()
    hooked_model, plain_model, noop_model = Model(), Model(), Model()
    tracer.instrument(hooked_model, modules=("mlp",))
    noop_model.mlp.register_forward_pre_hook(lambda *_: None)
    noop_model.mlp.register_forward_hook(lambda *_: None)
    x, per = torch.ones(1), max(100, n // (4 * rounds))

    def run(mod: Any) -> float:
        return _ns_per_call(tracer, lambda: mod(x), per)

    out = _interleaved(lambda: run(hooked_model.mlp), lambda: run(plain_model.mlp), rounds)
    dispatch = _interleaved(lambda: run(noop_model.mlp), lambda: run(plain_model.mlp), rounds)
    tracer.close(timeout_s=5)
    return out, dispatch


def bench_ddp_bucket(n: int, rounds: int = 15) -> float:
    """ns the argus DDP communication hook adds per bucket (see the module docstring)."""
    import torch

    from argus.producers.tracer_ddp import CommChain, _argus_comm_hook

    class Bucket:
        def __init__(self) -> None:
            self._buf = torch.ones(4)

        def buffer(self) -> Any:
            return self._buf

    def done_hook(state: Any, bucket: Any) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    tracer = _bench_tracer()
    chain = CommChain(tracer, "dp-allreduce", ParallelGroup.DP, None, done_hook, None)
    bucket, per = Bucket(), max(100, n // (4 * rounds))
    perf = time.perf_counter_ns

    def run(timed: bool) -> float:
        _drained(tracer)
        with tracer.step():
            t0 = perf()
            if timed:
                for _ in range(per):
                    _argus_comm_hook(chain, bucket).wait()
            else:
                for _ in range(per):
                    done_hook(None, bucket).wait()
            return (perf() - t0) / per

    out = _interleaved(lambda: run(True), lambda: run(False), rounds)
    tracer.close(timeout_s=5)
    return out


def bench_model_step(n: int, rounds: int = 9) -> float:
    """ns the whole-model hooks add to one forward + backward of a one-layer model."""
    import torch

    tracer = _bench_tracer()
    hooked, plain = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    tracer.instrument_model(hooked)
    x, per = torch.ones(2, 4), max(20, n // (4 * rounds))

    def run(model: Any) -> float:
        return _ns_per_call(tracer, lambda: model(x).sum().backward(), per)

    out = _interleaved(lambda: run(hooked), lambda: run(plain), rounds)
    tracer.close(timeout_s=5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--phases", type=int, default=200_000)
    ap.add_argument("--hooks", type=int, default=150_000, help="module calls / DDP buckets per measurement")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out: dict[str, Any] = bench_kernels(args.records)
    host = bench_phases(args.phases, cuda=False)
    out["ns_per_phase"] = round(host["phase"], 1)
    out["ns_per_step"] = round(host["step"], 1)
    out["ns_per_phase_heartbeat"] = round(bench_heartbeat(max(1_000, args.phases // 4)), 1)
    out["ns_per_phase_heartbeat_state"] = round(bench_live_state(), 1)
    out["ns_per_phase_cuda"] = None
    try:
        module_call, dispatch = bench_module_hooks(args.hooks)
        out["ns_per_module_call"] = round(module_call, 1)
        out["ns_per_module_call_torch_dispatch"] = round(dispatch, 1)
        out["ns_per_ddp_bucket"] = round(bench_ddp_bucket(args.hooks), 1)
        out["ns_per_model_step"] = round(bench_model_step(max(200, args.hooks // 50)), 1)
    except ImportError:  # no torch: the hooks do not exist either
        out["ns_per_module_call"] = out["ns_per_ddp_bucket"] = out["ns_per_model_step"] = None
        out["ns_per_module_call_torch_dispatch"] = None
    try:
        import torch
        if torch.cuda.is_available():
            out["ns_per_phase_cuda"] = round(bench_phases(args.phases // 4, cuda=True)["phase"], 1)
    except ImportError:
        pass
    out["training_thread_ns_per_kernel_record"] = 0
    out["budget_ns_per_kernel_record"] = BUDGET_NS_PER_KERNEL_RECORD
    out["budget_ns_per_phase"] = BUDGET_NS_PER_PHASE
    out["budget_ns_per_phase_heartbeat"] = BUDGET_NS_PER_PHASE_HEARTBEAT
    out["budget_ns_per_module_call"] = BUDGET_NS_PER_MODULE_CALL
    out["budget_ns_per_ddp_bucket"] = BUDGET_NS_PER_DDP_BUCKET
    out["ok"] = (out["ns_per_kernel_record"] <= BUDGET_NS_PER_KERNEL_RECORD
                 and out["ns_per_phase"] <= BUDGET_NS_PER_PHASE
                 and out["ns_per_phase_heartbeat"] <= BUDGET_NS_PER_PHASE_HEARTBEAT
                 and (out["ns_per_module_call"] is None or out["ns_per_module_call"] <= BUDGET_NS_PER_MODULE_CALL)
                 and (out["ns_per_ddp_bucket"] is None or out["ns_per_ddp_bucket"] <= BUDGET_NS_PER_DDP_BUCKET))
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
