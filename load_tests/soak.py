"""Soak: simulated jobs through the real local stack at a steady rate; the worker's and the sink's memory
must stay flat.

``python load_tests/soak.py [--minutes 30] [--job-every-s 20]`` starts a private stack (``argus up`` with its
own home, ports, topics and groups, as :mod:`load_tests.detection_eval` does), then every ``--job-every-s``
seconds publishes one simulated job (``argus.producers.simulator``: 8-32 ranks, 10-30 steps, a random fault or
none). Every ``--crash-every``-th job crashes (its END is never sent: the stack must not keep it forever),
every ``--poison-every``-th job carries poison in its middle (undecodable bytes, a record out of range, an
event far in the future), which must end in the dead letters. The worker's and the sink's resident memory
(``/proc/<pid>/status`` ``VmRSS``) is sampled every ``--sample-s`` seconds.

Prints one JSON line: minutes, jobs (sent, crashed, with poison, diagnosed), kernel events and events/s, per
process the RSS at the end of warm-up and at the end and its slope (MB/h, least squares over the samples
after the first quarter; for the worker, with the messages it holds for open jobs as a second regressor, since
that memory is bounded by design and comes and goes with the jobs in flight: see ``held_slope_mb_per_h``; the
plain slope is printed too, as ``rss_slope_raw_mb_per_h``), dead letters stored, restarts seen by the
supervisor, and the budgets: each RSS slope at most ``RSS_SLOPE_BUDGET_MB_PER_H`` and every poison message in
the dead letters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from detection_eval import PrivateStack  # noqa: E402

from argus.core.settings import Settings  # noqa: E402
from argus.producers.publisher import Publisher  # noqa: E402
from argus.producers.simulator import JobSimulator  # noqa: E402
from argus.schemas.records import JobLifecycle, KernelBatch, LifecycleEvent, Step  # noqa: E402
from argus.topics import Topic, job_key, rank_key  # noqa: E402

#: Most a process's resident memory may grow per hour once warm (MB/h).
RSS_SLOPE_BUDGET_MB_PER_H = 50.0
#: Longest wait after the last job for its records to reach the store (s).
DRAIN_S = 240.0
_FAULTS = ("none", "case1", "case2", "case3", "case4", "case5")


def _say(msg: str) -> None:
    sys.stderr.write(f"[soak {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MB, None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def slope_mb_per_h(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples after the first quarter (warm-up), in MB per hour."""
    warm = samples[len(samples) // 4:]
    if len(warm) < 3:
        return None
    t = np.array([s[0] for s in warm])
    m = np.array([s[1] for s in warm])
    return float(np.polyfit(t, m, 1)[0] * 3600.0)


def held_slope_mb_per_h(samples: list[tuple[float, float]], held: list[tuple[float, dict[str, int]]]
                        ) -> tuple[float | None, float | None]:
    """The worker's RSS slope (MB/h) once what it holds by design is accounted for, and the MB per held message.

    Messages of open jobs stay held (un-acked, in memory) until their job is diagnosed or abandoned, so the
    worker's RSS follows how many it holds (a crashed job holds its records for ``job_idle_timeout_s``). A
    least-squares fit of RSS on time *and* held messages, after warm-up, separates that bounded, coming-and-going
    memory from growth over time (a leak).
    """
    by_t = {round(t, 3): h.get("held_messages", -1) for t, h in held}
    rows = [(t, mb, by_t.get(round(t, 3), -1)) for t, mb in samples[len(samples) // 4:]]
    rows = [r for r in rows if r[2] >= 0]
    if len(rows) < 3:
        return None, None
    x = np.array([[1.0, t, h] for t, _, h in rows])
    coef = np.linalg.lstsq(x, np.array([mb for _, mb, _ in rows]), rcond=None)[0]
    return float(coef[1] * 3600.0), float(coef[2])


class RssSampler:
    """The resident memory (MB) of a stack's ``service`` (its pid file under ``home``), every ``every_s``
    seconds in a thread while the ``with`` block runs: ``samples`` holds (seconds since start, MB)."""

    def __init__(self, home: Path, service: str = "worker", every_s: float = 2.0) -> None:
        self.home, self.service, self.every_s = home, service, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            pid = _pid(self.home, self.service)
            mb = rss_mb(pid) if pid else None
            if mb is not None:
                self.samples.append((time.monotonic() - self._t0, mb))
            self._stop.wait(self.every_s)

    def summary(self) -> dict[str, Any]:
        """Start, peak and end MB (None without samples) and the number of samples."""
        mbs = [m for _, m in self.samples]
        return {"start": round(mbs[0], 1) if mbs else None, "peak": round(max(mbs), 1) if mbs else None,
                "end": round(mbs[-1], 1) if mbs else None, "samples": len(mbs)}

    def peak_mb(self) -> float | None:
        return max((m for _, m in self.samples), default=None)


def _pid(home: Path, service: str) -> int | None:
    path = home / "run" / f"{service}.pid"
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _poison(settings: Settings, job_id: str, world: int, pub: Publisher, raw: Any) -> int:
    """Three poison messages for ``job_id``: undecodable bytes, a step of a rank outside the job, a kernel
    batch far in the future. Returns how many were sent."""
    raw.produce(Topic.KERNELS.full(settings), key=rank_key(job_id, 0), value=b"\xa7\x01not avro at all")
    pub.publish(Topic.STEPS, job_key(job_id), Step(job_id=job_id, rank=world + 7, step=3, start_ns=10**18,
                                                    wall_ns=1_000_000, gpu_ns=900_000))
    future = KernelBatch(job_id=job_id, rank=0, seq=10**6, names=("poison_kernel",),
                         name_idx=np.zeros(4, np.uint32), stream=np.full(4, 7, np.uint32),
                         start_ns=np.full(4, 4 * 10**18, np.int64), duration_ns=np.full(4, 1000, np.int64),
                         step=np.zeros(4, np.int32), host="soak")
    pub.publish(Topic.KERNELS, rank_key(job_id, 0), future)
    raw.flush(10)
    return 3


def run(minutes: float, job_every_s: float, crash_every: int, poison_every: int, sample_s: float,
        seed: int, samples_out: Path | None = None) -> dict[str, Any]:
    from confluent_kafka import Producer

    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="argus-soak-"))
    stack = PrivateStack(work / "home", partitions=4)
    stack.up()
    os.environ.update({k: v for k, v in stack.env.items() if k.startswith("ARGUS_")})
    settings = Settings.load()
    raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
    samples: dict[str, list[tuple[float, float]]] = {"worker": [], "sink": []}
    # What the worker holds by design at each sample (messages of open jobs, open windows): memory that comes
    # and goes with the jobs in flight, not a leak.
    held: list[tuple[float, dict[str, int]]] = []
    sent = crashed = poisoned = poison_msgs = events = 0
    jobs: list[str] = []
    t0 = time.monotonic()
    next_job = next_sample = t0
    try:
        while time.monotonic() - t0 < minutes * 60.0:
            now = time.monotonic()
            if now >= next_sample:
                for svc in samples:
                    pid = _pid(stack.home, svc)
                    mb = rss_mb(pid) if pid else None
                    if mb is not None:
                        samples[svc].append((now - t0, mb))
                held.append((now - t0, _held_state(stack)))
                next_sample += sample_s
            if now >= next_job:
                sent += 1
                job = f"soak-{seed}-{sent:05d}"
                dp, tp, pp = rng.choice([(4, 2, 1), (8, 2, 2), (4, 2, 2), (8, 1, 1)])
                crash = crash_every > 0 and sent % crash_every == 0
                poison = poison_every > 0 and sent % poison_every == 0
                sim = JobSimulator(_spec(job, dp, tp, pp, rng.randint(10, 30), rng.choice(_FAULTS), sent),
                                   batch_events=settings.publisher_batch_events)
                with Publisher(settings, lossless=True) as pub:
                    records = list(sim.records())
                    half = len(records) // 2
                    for i, rec in enumerate(records):
                        if i == half and poison:
                            poison_msgs += _poison(settings, job, dp * tp * pp, pub, raw)
                        if crash and isinstance(rec.record, JobLifecycle) and rec.record.event is LifecycleEvent.END:
                            continue
                        if isinstance(rec.record, KernelBatch):
                            events += len(rec.record)
                        pub.publish(rec.topic, rec.key, rec.record)
                    pub.close()
                crashed += crash
                poisoned += poison
                jobs.append(job)
                next_job += job_every_s
            time.sleep(0.2)
        wall = time.monotonic() - t0
        # The last jobs are still in flight: let the stack drain before counting what reached the store.
        drain_until = time.monotonic() + DRAIN_S
        dead = _scalar(stack, "SELECT count() FROM dead_letters FINAL")
        while (dead is None or dead < poison_msgs) and time.monotonic() < drain_until:
            time.sleep(5.0)
            dead = _scalar(stack, "SELECT count() FROM dead_letters FINAL")
        diagnosed = _scalar(stack, "SELECT uniqExact(job_id) FROM jobs FINAL WHERE event = 'DIAGNOSED'")
        status = stack.argus("status", "--json", timeout=60)
    finally:
        stack.down()
    raw = {svc: slope_mb_per_h(s) for svc, s in samples.items()}
    # The sink holds nothing between batches; the worker holds open jobs' messages (see held_slope_mb_per_h).
    worker_slope, per_held = held_slope_mb_per_h(samples["worker"], held)
    slopes = {"worker": worker_slope, "sink": raw["sink"]}
    if samples_out is not None:
        samples_out.write_text(json.dumps({"rss_mb": samples, "held": held}))
    out: dict[str, Any] = {
        "minutes": round(wall / 60.0, 1), "jobs": sent, "crashed_jobs": crashed, "jobs_with_poison": poisoned,
        "poison_messages": poison_msgs, "jobs_diagnosed": diagnosed, "kernel_events": events,
        "events_per_s": round(events / wall) if wall else None, "dead_letters": dead,
        "rss_mb": {svc: {"warm": round(s[len(s) // 4][1], 1) if s else None, "end": round(s[-1][1], 1) if s else None,
                         "samples": len(s)} for svc, s in samples.items()},
        "rss_slope_mb_per_h": {svc: None if v is None else round(v, 1) for svc, v in slopes.items()},
        "rss_slope_raw_mb_per_h": {svc: None if v is None else round(v, 1) for svc, v in raw.items()},
        "worker_kb_per_held_message": None if per_held is None else round(per_held * 1024, 2),
        "worker_held_messages": {"max": max((h.get("held_messages", 0) for _, h in held), default=None),
                                 "end": held[-1][1].get("held_messages") if held else None},
        "status": _json_or_text(status.stdout),
        "budgets": {"rss_slope_mb_per_h": RSS_SLOPE_BUDGET_MB_PER_H},
    }
    out["budgets_ok"] = (all(v is not None and v <= RSS_SLOPE_BUDGET_MB_PER_H for v in slopes.values())
                         and dead is not None and dead >= poison_msgs)
    return out


def _held_state(stack: PrivateStack) -> dict[str, int]:
    """The worker's open jobs, held messages and open windows (from its ``/stats``), -1 when it does not answer."""
    import urllib.request

    try:
        port = stack.env["ARGUS_WORKER_WEB_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=2) as r:
            doc = json.loads(r.read())
        diag = doc.get("diagnosis") or {}
        return {"open_jobs": int(diag.get("open_jobs", 0)), "held_messages": int(diag.get("held_messages", 0)),
                "open_windows": int(doc.get("open_windows", 0)), "pending": int(doc.get("pending_messages", 0))}
    except (OSError, ValueError, KeyError):
        return {"open_jobs": -1, "held_messages": -1, "open_windows": -1, "pending": -1}


def _spec(job: str, dp: int, tp: int, pp: int, steps: int, fault: str, seed: int) -> Any:
    from argus.core.errors import ArgusError
    from argus.demo import build_spec

    try:
        return build_spec(job, dp, tp, pp, steps, fault, seed)
    except ArgusError:  # a fault this topology cannot have (a pipeline fault without stages): a healthy job
        return build_spec(job, dp, tp, pp, steps, "none", seed)


def _scalar(stack: PrivateStack, sql: str) -> int | None:
    db = stack.env.get("ARGUS_CLICKHOUSE_DATABASE", "argus")
    res = stack.argus("sql", "--json", sql.replace(" FROM ", f" FROM `{db}`."), timeout=120)
    if res.returncode != 0:
        _say(f"query failed: {res.stderr[-300:]}")
        return None
    rows = _json_or_text(res.stdout)
    try:
        return int(next(iter(rows[0].values())))
    except (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError):
        return None


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text[-500:]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--job-every-s", type=float, default=20.0)
    ap.add_argument("--crash-every", type=int, default=5, help="every n-th job never sends END (0: none)")
    ap.add_argument("--poison-every", type=int, default=4, help="every n-th job carries poison (0: none)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples-out", type=Path, default=None,
                    help="write every RSS sample and the worker's held state at each to this JSON file")
    args = ap.parse_args(argv)
    # A soak started in the background ignores SIGINT; SIGTERM stops it through the same path, so its
    # private stack is taken down either way.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    out = run(args.minutes, args.job_every_s, args.crash_every, args.poison_every, args.sample_s, args.seed,
              args.samples_out)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out["budgets_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
