"""Randomized detection evaluation: generated Kineto traces with known faults, diagnosed by the real stack.

Each scenario (``load_tests/kineto_scenarios.py``: an independent Megatron-style job generator, one trace file
per rank) is written to a temporary folder, imported and diagnosed, and its findings are scored against the
scenario's truth (:func:`kineto_scenarios.score_findings`):

* ``--mode stack`` (default): starts a private local stack once (``argus up`` with its own ``ARGUS_HOME``,
  Kafka port, SQL and worker ports, topic prefix and consumer groups, so it never meets another stack on the
  machine), then per scenario ``argus import-kineto DIR --job J`` and ``argus findings --job J --wait 300
  --json``; ``argus down`` at the end, also on errors and Ctrl-C. *Time to findings* is from the start of the
  import to the findings returned.
* ``--mode inproc``: the same scoring with the diagnosis in-process through
  ``argus.streams.offline.diagnose_traces(directory, job_id)`` (skipped with a message where it does not exist).

A scenario whose traces carry no ``pg_config`` is imported with ``--topology`` (``kineto_scenarios.topology_flag``),
as its operator would. Scenario classes are drawn in equal shares (``kineto_scenarios.FAULT_CLASSES``); every
scenario has its own seed, and ``--only-seed S --fault CLASS [--max-ranks M]`` reruns exactly that one. ``--details
PATH`` writes one JSON line per scenario (truth, findings, score, timings, the rerun command). Progress goes to
stderr; the result is one JSON line on stdout; per class it also gives the findings and the incidents (findings
grouped by cause, ``incident_id``: docs/incidents.md) per job, e.g. how many of each a slow host yields. Budgets:
exact match >= 0.97 of scenarios and >= 0.92 in every class, and zero findings on >= 0.99 of healthy jobs; exit
code 1 when a budget fails.

Run: .venv/bin/python load_tests/detection_eval.py [--scenarios 200] [--seed 0] [--max-ranks 512]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, cast

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from load_tests.kineto_scenarios import (  # noqa: E402
    FAULT_CLASSES,
    Scenario,
    incident_ids,
    score_findings,
    simulate,
    topology_flag,
    write_scenario,
)

#: Budgets: share of scenarios diagnosed exactly, and of healthy jobs with no finding at all.
BUDGET_EXACT = 0.97
BUDGET_CLASS_EXACT = 0.92
BUDGET_HEALTHY_ZERO = 0.99
FINDINGS_WAIT_S = 300
_FINDING_KEYS = ("level", "kind", "ranks", "hosts", "phase", "kernel", "stream", "steps", "score", "finding_id",
                 "incident_id")


def _say(msg: str) -> None:
    sys.stderr.write(f"[eval {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def scenario_seed(base: int, index: int) -> int:
    """The seed of scenario ``index`` of a run with ``--seed base``."""
    return int(np.random.SeedSequence([base, index]).generate_state(1)[0] & 0x7FFFFFFF)


def plan(n: int, base: int, fault: str | None) -> list[tuple[int, str]]:
    """(seed, class) of each scenario: classes in equal shares (shuffled), unless ``fault`` fixes one."""
    if fault:
        classes = [fault] * n
    else:
        rng = np.random.default_rng([base, 1])
        classes = [str(c) for c in rng.permutation(np.resize(np.array(FAULT_CLASSES), n))]
    return [(scenario_seed(base, i), c) for i, c in enumerate(classes)]


def generate(seed: int, fault: str, max_ranks: int, parent: str) -> dict[str, Any]:
    """Write one scenario under a new folder in ``parent`` (runs in a worker process)."""
    t0 = time.perf_counter()
    scn = Scenario.from_seed(seed, fault, max_ranks)
    tl = simulate(scn)
    t1 = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix=f"scn-{fault}-{seed}-", dir=parent))
    traces = write_scenario(scn, out, tl)
    truth = json.loads((out / "truth.json").read_text())
    # A trace without pg_config names no group: its operator passes the topology (--topology).
    return {"dir": str(out), "traces": str(traces), "truth": truth, "topology": topology_flag(scn),
            "simulate_s": t1 - t0,
            "write_s": time.perf_counter() - t1, "kernel_events": int(tl.rank.shape[0]),
            "bytes": sum(p.stat().st_size for p in traces.iterdir())}


# -- the private stack -------------------------------------------------------------------------------------


def free_port(pair: bool = False) -> int:
    """A free loopback port (with ``pair``, the next one is free too: the local broker's controller)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not pair or port >= 65535:
            return port
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


class PrivateStack:
    """``argus up``/``down`` with settings of its own (home, ports, topics, groups) via ``ARGUS_*``."""

    def __init__(self, home: Path, partitions: int) -> None:
        tag = uuid.uuid4().hex[:8]
        self.home = home
        self.env = {**os.environ,
                    "ARGUS_HOME": str(home), "ARGUS_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port(pair=True)}",
                    "ARGUS_QUERY_PORT": str(free_port()), "ARGUS_WORKER_WEB_PORT": str(free_port()),
                    "ARGUS_SINK_METRICS_PORT": str(free_port()),
                    "ARGUS_TOPIC_PREFIX": f"eval{tag}.", "ARGUS_APP_ID": f"argus-eval-{tag}",
                    "ARGUS_SINK_GROUP": f"argus-eval-sink-{tag}", "ARGUS_PARTITIONS": str(partitions),
                    "ARGUS_CLICKHOUSE_DSN": f"chdb://{home / 'chdb'}"}
        for key in ("ARGUS_LOG_LEVEL",):
            self.env.pop(key, None)
        self.up_done = False

    def argus(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "argus.cli", *args], env=self.env, cwd=ROOT, text=True,
                              capture_output=True, timeout=timeout)

    def up(self) -> None:
        _say(f"argus up (home {self.home}, kafka {self.env['ARGUS_BOOTSTRAP_SERVERS']})")
        self.up_done = True
        res = self.argus("up", timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"argus up failed ({res.returncode}):\n{res.stderr[-3000:]}")

    def down(self) -> None:
        if not self.up_done:
            return
        try:
            res = self.argus("down", timeout=180)
            _say("argus down" + ("" if res.returncode == 0 else f" failed: {res.stderr[-500:]}"))
        except subprocess.TimeoutExpired:
            _say("argus down timed out")

    def logs(self) -> str:
        out = []
        for name in ("worker", "sink"):
            p = self.home / "run" / f"{name}.log"
            if p.exists():
                out.append(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(out)

    def wait_findings(self, job: str, wait_s: int) -> tuple[bool, list[dict[str, Any]]]:
        """``argus findings --job J --wait S --json``: whether the job was diagnosed in time, and its findings."""
        res = self.argus("findings", "--job", job, "--wait", str(wait_s), "--json", timeout=wait_s + 60)
        if res.returncode != 0:
            _say(f"findings --wait failed: {res.stderr[-500:]}")
            return False, []
        return True, json.loads(res.stdout)

    def diagnose(self, traces: str, job: str, topology: str | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        flag = ("--topology", topology) if topology else ()
        imp = self.argus("import-kineto", traces, "--job", job, *flag, timeout=1800)
        t1 = time.perf_counter()
        if imp.returncode != 0:
            return {"error": f"import-kineto exit {imp.returncode}: {imp.stderr[-2000:]}", "import_s": t1 - t0}
        try:
            report = json.loads(imp.stdout)
        except ValueError:
            report = {}
        fnd = self.argus("findings", "--job", job, "--wait", str(FINDINGS_WAIT_S), "--json",
                         timeout=FINDINGS_WAIT_S + 120)
        t2 = time.perf_counter()
        out: dict[str, Any] = {"import_s": t1 - t0, "findings_s": t2 - t1, "time_to_findings_s": t2 - t0,
                               "diagnosed": fnd.returncode == 0,
                               "import": {k: report.get(k) for k in ("topology", "topology_source", "kernel_events",
                                                                      "steps", "phases", "clock_aligned",
                                                                      "records_dropped", "messages")}}
        if fnd.returncode not in (0, 4):
            out["error"] = f"findings exit {fnd.returncode}: {fnd.stderr[-2000:]}"
            return out
        try:
            out["findings"] = json.loads(fnd.stdout)
        except ValueError as exc:
            out["error"] = f"findings: not JSON ({exc}): {fnd.stdout[-500:]}"
        return out


def _inproc_diagnose() -> Callable[..., list[dict[str, Any]]] | None:
    try:
        mod = importlib.import_module("argus.streams.offline")
    except ImportError:
        return None
    fn = getattr(mod, "diagnose_traces", None)
    return cast(Callable[..., list[dict[str, Any]]], fn) if callable(fn) else None


def inproc_one(seed: int, fault: str, max_ranks: int, parent: str, job: str, keep: bool) -> dict[str, Any]:
    """Generate and diagnose one scenario in this (worker) process."""
    diagnose = _inproc_diagnose()
    assert diagnose is not None
    gen = generate(seed, fault, max_ranks, parent)
    t0 = time.perf_counter()
    try:
        findings = diagnose(Path(gen["traces"]), job, topology=gen["topology"])
        res: dict[str, Any] = {"findings": findings, "diagnosed": True}
    except Exception as exc:  # a crash of the detectors is a result to report, not a reason to stop
        res = {"error": f"{type(exc).__name__}: {exc}"}
    res["time_to_findings_s"] = time.perf_counter() - t0
    if not keep:
        shutil.rmtree(gen["dir"], ignore_errors=True)
    return {**gen, **res}


# -- scoring -----------------------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    per: dict[str, dict[str, Any]] = defaultdict(lambda: {"n": 0, "exact": 0, "tp": 0, "fp": 0, "fn": 0,
                                                          "findings": [], "incidents": []})
    times, healthy, healthy_zero, healthy_false = [], 0, 0, 0
    for r in rows:
        c = per[r["fault"]]
        s = r["score"]
        c["n"] += 1
        c["exact"] += int(s["exact"])
        for k in ("tp", "fp", "fn"):
            c[k] += s[k]
        if not r.get("error"):
            c["findings"].append(len(r.get("findings") or []))
            c["incidents"].append(len(incident_ids(r.get("findings") or [])))
        if r.get("time_to_findings_s") is not None and not r.get("error"):
            times.append(r["time_to_findings_s"])
        if r["fault"] == "healthy":
            healthy += 1
            n_f = len(r.get("findings") or [])
            healthy_zero += int(n_f == 0 and not r.get("error"))
            healthy_false += n_f
    tot = {k: sum(c[k] for c in per.values()) for k in ("n", "exact", "tp", "fp", "fn")}

    def ratio(a: int, b: int) -> float | None:
        return round(a / b, 4) if b else None

    per_class = {cls: {"n": c["n"], "precision": ratio(c["tp"], c["tp"] + c["fp"]),
                       "recall": ratio(c["tp"], c["tp"] + c["fn"]), "exact_match_rate": ratio(c["exact"], c["n"]),
                       # Findings and incidents (findings grouped by cause, docs/incidents.md) per job.
                       "findings_per_job": _spread(c["findings"]), "incidents_per_job": _spread(c["incidents"])}
                 for cls, c in sorted(per.items())}
    exact = ratio(tot["exact"], tot["n"]) or 0.0
    hz = ratio(healthy_zero, healthy)
    weak = sorted(cls for cls, c in per_class.items() if (c["exact_match_rate"] or 0.0) < BUDGET_CLASS_EXACT)
    return {
        "scenarios": tot["n"], "exact_match_rate": exact, "healthy_zero_findings_rate": hz,
        "false_findings_per_healthy_job": ratio(healthy_false, healthy),
        "mean_time_to_findings_s": round(float(np.mean(times)), 2) if times else None,
        "p95_time_to_findings_s": round(float(np.percentile(times, 95)), 2) if times else None,
        "precision": ratio(tot["tp"], tot["tp"] + tot["fp"]), "recall": ratio(tot["tp"], tot["tp"] + tot["fn"]),
        "errors": sum(1 for r in rows if r.get("error")),
        "undiagnosed": sum(1 for r in rows if not r.get("diagnosed", False)),
        "per_class": per_class,
        "budgets": {"exact_match_rate": BUDGET_EXACT, "class_exact_match_rate": BUDGET_CLASS_EXACT,
                    "healthy_zero_findings_rate": BUDGET_HEALTHY_ZERO},
        "classes_under_budget": weak,
        "budgets_ok": bool(tot["n"]) and exact >= BUDGET_EXACT and not weak
                      and (hz is None or hz >= BUDGET_HEALTHY_ZERO),
    }


def _row(i: int, seed: int, fault: str, max_ranks: int, job: str, gen: dict[str, Any],
         res: dict[str, Any]) -> dict[str, Any]:
    truth = gen["truth"]
    findings = res.get("findings") or []
    score = score_findings(truth, findings)
    if res.get("error"):
        score["exact"] = False
    scn = truth["scenario"]
    return {
        "i": i, "seed": seed, "fault": fault, "max_ranks": max_ranks, "job": job,
        "world": scn["world"], "topology": {k: scn[k] for k in ("dp", "tp", "pp", "ep", "moe")},
        "pg_variant": "args" if scn.get("pg_args") else "pg_config" if scn.get("pg_config", True) else "none",
        "steps": scn["steps"], "magnitude": round(scn["magnitude"], 3), "onset": scn["onset"],
        "kernel_events": gen["kernel_events"], "trace_mb": round(gen["bytes"] / 1e6, 1),
        "simulate_s": round(gen["simulate_s"], 2), "write_s": round(gen["write_s"], 2),
        "import_s": _r(res.get("import_s")), "findings_s": _r(res.get("findings_s")),
        "time_to_findings_s": _r(res.get("time_to_findings_s")), "diagnosed": res.get("diagnosed", False),
        "error": res.get("error"), "import": res.get("import"),
        "truth": {k: truth[k] for k in ("expected", "optional", "tolerated", "iteration_growth")},
        "findings": [{k: f.get(k) for k in _FINDING_KEYS} for f in findings],
        "score": score, "scenario": scn,
        "rerun": f".venv/bin/python load_tests/detection_eval.py --only-seed {seed} --fault {fault} "
                 f"--max-ranks {max_ranks}",
    }


def _spread(xs: list[int]) -> dict[str, float] | None:
    """Mean, median and largest of per-job counts."""
    if not xs:
        return None
    return {"mean": round(float(np.mean(xs)), 2), "median": float(np.median(xs)), "max": int(max(xs))}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _progress(row: dict[str, Any], n: int) -> None:
    s = row["score"]
    what = "OK " if s["exact"] else "BAD"
    extra = ""
    if not s["exact"]:
        missing = [(m["kinds"][0], m["ranks"][:8], m.get("named", [])[:8]) if "kinds" in m else m
                   for m in s["missing"]]
        false = [(f["kind"], (f["ranks"] or [])[:8], (f["steps"] or [])[:4]) for f in s["false"][:4]]
        extra = f" missing={missing} false={false}" + (f" (+{len(s['false']) - 4})" if len(s["false"]) > 4 else "")
    timing = (f"import={row['import_s']}s findings={row['findings_s']}s" if row["import_s"] is not None
              else f"diagnose={row['time_to_findings_s']}s")
    _say(f"{row['i'] + 1}/{n} {what} {row['fault']:<17} seed={row['seed']} W={row['world']} "
         f"ev={row['kernel_events']} gen={row['simulate_s'] + row['write_s']:.1f}s {timing}{extra}"
         + (f" ERROR {str(row['error'])[:300]}" if row.get("error") else ""))


# -- main --------------------------------------------------------------------------------------------------


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _prefetch(pool: cf.ProcessPoolExecutor, jobs: list[tuple[int, str]], max_ranks: int, parent: str,
              ahead: int) -> Iterator[tuple[int, cf.Future[dict[str, Any]]]]:
    """Generation futures in order, at most ``ahead`` submitted beyond the one being consumed."""
    pending: list[tuple[int, cf.Future[dict[str, Any]]]] = []
    nxt = 0
    while nxt < len(jobs) or pending:
        while nxt < len(jobs) and len(pending) <= ahead:
            seed, fault = jobs[nxt]
            pending.append((nxt, pool.submit(generate, seed, fault, max_ranks, parent)))
            nxt += 1
        yield pending.pop(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--scenarios", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ranks", type=int, default=512)
    ap.add_argument("--mode", choices=("stack", "inproc"), default="stack")
    ap.add_argument("--workers", type=int, default=1,
                    help="processes generating scenarios ahead (stack) or generating and diagnosing (inproc)")
    ap.add_argument("--keep", action="store_true", help="keep every generated scenario folder (see --workdir)")
    ap.add_argument("--workdir", type=Path, default=None, help="where scenario folders go (default: a temp dir)")
    ap.add_argument("--details", type=Path, default=None, help="JSONL file: one line per scenario")
    ap.add_argument("--only-seed", type=int, default=None, help="run the one scenario with this seed")
    ap.add_argument("--fault", choices=FAULT_CLASSES, default=None, help="only this class")
    ap.add_argument("--partitions", type=int, default=4, help="topic partitions of the private stack")
    args = ap.parse_args(argv)
    if args.only_seed is not None and not args.fault:
        ap.error("--only-seed needs --fault (a seed is a scenario of one class)")
    if args.scenarios < 1 or args.max_ranks < 1 or args.workers < 1:
        ap.error("--scenarios, --max-ranks and --workers must be >= 1")
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        ap.error(f"--workdir {args.workdir} is not a folder")
    jobs = [(args.only_seed, args.fault)] if args.only_seed is not None else plan(args.scenarios, args.seed,
                                                                                 args.fault)
    if args.mode == "inproc" and _inproc_diagnose() is None:
        _say("inproc mode skipped: argus.streams.offline.diagnose_traces does not exist yet")
        skipped = {"mode": "inproc", "skipped": "argus.streams.offline.diagnose_traces not found"}
        sys.stdout.write(json.dumps(skipped) + "\n")
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with SIGINT ignored (nohup, &)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="argus-eval-", dir=args.workdir))
    tag = uuid.uuid4().hex[:6]
    details = args.details.open("w") if args.details else None
    rows: list[dict[str, Any]] = []
    stack: PrivateStack | None = None
    t_start = time.perf_counter()
    interrupted = False
    try:
        if args.mode == "stack":
            stack = PrivateStack(work / "home", args.partitions)
            stack.up()
        scn_dir = work / "scenarios"
        scn_dir.mkdir(exist_ok=True)
        with cf.ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
            if args.mode == "stack":
                assert stack is not None
                for i, fut in _prefetch(pool, jobs, args.max_ranks, str(scn_dir), max(1, args.workers)):
                    seed, fault = jobs[i]
                    job = f"eval-{tag}-{i:04d}-{fault}-{seed}"
                    gen = fut.result()
                    res = stack.diagnose(gen["traces"], job, gen["topology"])
                    if not args.keep:
                        shutil.rmtree(gen["dir"], ignore_errors=True)
                    row = _row(i, seed, fault, args.max_ranks, job, gen, res)
                    if args.keep:
                        row["dir"] = gen["dir"]
                    rows.append(row)
                    _progress(row, len(jobs))
                    if details:
                        details.write(json.dumps(row) + "\n")
                        details.flush()
            else:
                futs = {pool.submit(inproc_one, seed, fault, args.max_ranks, str(scn_dir),
                                    f"eval-{tag}-{i:04d}-{fault}-{seed}", args.keep): i
                        for i, (seed, fault) in enumerate(jobs)}
                for fut in cf.as_completed(futs):
                    i = futs[fut]
                    seed, fault = jobs[i]
                    out = fut.result()
                    row = _row(i, seed, fault, args.max_ranks, f"eval-{tag}-{i:04d}-{fault}-{seed}", out, out)
                    rows.append(row)
                    _progress(row, len(jobs))
                    if details:
                        details.write(json.dumps(row) + "\n")
                        details.flush()
    except KeyboardInterrupt:
        interrupted = True
        _say("interrupted: stopping")
    except Exception as exc:
        _say(f"failed: {type(exc).__name__}: {exc}")
        if stack is not None:
            _say(stack.logs())
        raise
    finally:
        if stack is not None:
            stack.down()
        if details:
            details.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _say(f"scenario folders kept under {work / 'scenarios'}")
    result = {"mode": args.mode, "seed": args.seed, "max_ranks": args.max_ranks, **summarize(rows),
              "wall_s": round(time.perf_counter() - t_start, 1), "interrupted": interrupted}
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["budgets_ok"] and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
