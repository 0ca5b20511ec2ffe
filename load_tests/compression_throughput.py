"""Benchmark: kernel records/s through the compression agent, bytes per kernel event, compression ratio.

Two measurements on the same simulated 32-rank job (DP 8 x TP 2 x PP 2, realistic kernel mix):

* ``core``: decode + event-time windows + KDE summaries in-process (the agent's numeric work alone);
* ``agent``: the real Faust worker process reading a pre-loaded kernel topic on the project's local Kafka,
  timed from its first to its last processed batch (the throughput a worker sustains with a backlog);
  ``agent_core_ratio`` is agent / core (what the shell costs), ``load_avg_1m`` the machine's load at the end.

Bytes per kernel event are given as Avro payload bytes (what the publisher sends) and as bytes on the
broker's disk (after zstd, what the network and retention carry). The compression ratio compares kernel-batch
Avro bytes with the summary Avro bytes emitted for them.

Prints one JSON line; exits 1 if a budget is missed.
Run: .venv/bin/python load_tests/compression_throughput.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from argus.core.settings import Settings  # noqa: E402
from argus.demo import build_spec  # noqa: E402
from argus.local_kafka import LocalKafka  # noqa: E402
from argus.producers.publisher import Publisher  # noqa: E402
from argus.producers.simulator import JobSimulator  # noqa: E402
from argus.schemas.records import KernelBatch  # noqa: E402
from argus.streams.compression import summarize_windows  # noqa: E402
from argus.streams.windows import WindowBuffer  # noqa: E402
from argus.topics import Topic, ensure_topics  # noqa: E402

#: Budgets on this project's reference machine (2 cores): minimum kernel events/s, maximum bytes/event.
BUDGET_CORE_EVENTS_PER_S = 1_000_000
BUDGET_AGENT_EVENTS_PER_S = 2_000_000
#: Issue 10's wire budgets: Avro payload (kernel_batch v2, packed columns) and broker disk (after zstd).
BUDGET_AVRO_BYTES_PER_EVENT = 12.0
BUDGET_DISK_BYTES_PER_EVENT = 4.0


def _stats(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=1) as r:
            return json.loads(r.read())
    except OSError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--bootstrap", default="127.0.0.1:49092")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="argus-bench-"))
    tag = uuid.uuid4().hex[:6]
    settings = Settings.load(env={}, home=home, bootstrap_servers=args.bootstrap, topic_prefix=f"bench{tag}.",
                             app_id=f"bench-{tag}", partitions=8, worker_web_port=46066, session_timeout_s=6)
    spec = build_spec(f"bench-{tag}", 8, 2, 2, args.steps, "none")
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    kernels = [r.record for r in records if r.topic is Topic.KERNELS]
    n_events = sum(len(b) for b in kernels)
    payloads = [b.encode() for b in kernels]
    kernel_bytes = sum(map(len, payloads))

    # core: the agent's per-message work without Kafka
    buf = WindowBuffer(settings.window_ns, settings.allowed_lateness_ns)
    summary_bytes = 0
    t0 = time.perf_counter()
    for i, p in enumerate(payloads):
        up = buf.add(KernelBatch.decode(p), i)
        for s in summarize_windows(up.closed):
            summary_bytes += len(s.encode())
        for w in up.closed:
            buf.release(w)
    core_s = time.perf_counter() - t0

    broker = LocalKafka(settings)
    broker.start()
    worker = None
    try:
        ensure_topics(settings)
        with Publisher(settings, lossless=True) as pub:
            for b in kernels:
                pub.publish(Topic.KERNELS, f"{b.job_id}/{b.rank}".encode(), b)
            pub.flush(120)
        disk = sum(f.stat().st_size for d in broker.data_dir.glob(f"{Topic.KERNELS.full(settings)}-*")
                   for f in d.glob("*.log"))
        env = {**os.environ, **settings.to_env(), "ARGUS_LOG_LEVEL": "WARNING"}
        worker = subprocess.Popen([sys.executable, "-m", "argus.cli", "worker"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        first = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            s = _stats(settings.worker_web_port)
            if s and s["events_in"] and first is None:
                first = (time.monotonic(), s["events_in"])
            if s and s["events_summarized"] >= n_events:
                done = time.monotonic()
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"worker did not finish: {_stats(settings.worker_web_port)}")
        assert first is not None
        agent_eps = (n_events - first[1]) / max(1e-9, done - first[0])
        final = _stats(settings.worker_web_port) or {}
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        broker.stop()

    result = {
        "benchmark": "compression_throughput",
        "ranks": spec.world_size, "steps": args.steps, "kernel_events": n_events, "kernel_batches": len(kernels),
        "core_events_per_s": round(n_events / core_s),
        "agent_events_per_s": round(agent_eps),
        "agent_busy_events_per_s": final.get("events_per_busy_s"),
        # What the shell (Kafka, Faust, the worker's other agents) leaves of the core's rate: the number to push to 1.
        "agent_core_ratio": round(agent_eps / (n_events / core_s), 2),
        # Others' benchmarks share the reference machine: the figures above are read against this.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "avro_bytes_per_event": round(kernel_bytes / n_events, 2),
        "disk_bytes_per_event": round(disk / n_events, 2),
        "summary_bytes": summary_bytes,
        "compression_ratio": round(kernel_bytes / summary_bytes, 1),
        "raw_record_bytes_per_event": 28,
        "budgets": {"core_events_per_s": BUDGET_CORE_EVENTS_PER_S, "agent_events_per_s": BUDGET_AGENT_EVENTS_PER_S,
                    "avro_bytes_per_event": BUDGET_AVRO_BYTES_PER_EVENT,
                    "disk_bytes_per_event": BUDGET_DISK_BYTES_PER_EVENT},
    }
    ok = (result["core_events_per_s"] >= BUDGET_CORE_EVENTS_PER_S
          and result["agent_events_per_s"] >= BUDGET_AGENT_EVENTS_PER_S
          and result["avro_bytes_per_event"] <= BUDGET_AVRO_BYTES_PER_EVENT
          and result["disk_bytes_per_event"] <= BUDGET_DISK_BYTES_PER_EVENT)
    result["within_budget"] = ok
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
