"""A real 3-broker KRaft cluster under faults (issue 33): kill -9 of the broker leading the kernel partitions while
a job publishes, kill -9 of the active KRaft controller, a rolling restart of all three brokers during a job.

One ``argus up --brokers 3`` stack (RF 3, ``min.insync.replicas`` 2, every producer ``acks=all`` with
idempotence) serves the module. Each scenario publishes the suite's 32-rank job (the simulator, same seed) the way
a training process does (the publisher that never waits: ``publish`` is a put on a bounded queue) and checks,
against the same job published undisturbed on the same cluster: the kernel events summarized equal the events
published, no duplicate rows in the ``FINAL`` tables, the same steps, phases, windows and findings; nothing was
dropped or failed by the publisher; and ``publish`` never blocked the training thread past its budget (its p99
and maximum are measured over the calls made while the cluster was disturbed). The table of the figures is
printed at the end of the module and written to ``$ARGUS_FAULT_TABLE`` when set (see docs/cluster.md).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from argus.core.settings import Settings
from argus.demo import build_spec
from argus.kafka_cluster import KafkaCluster
from argus.producers.publisher import Publisher
from argus.producers.simulator import JobSimulator
from argus.topics import Topic
from tests.faults.conftest import (
    DP,
    DUPLICATE_FACTS,
    FAULT,
    PACE_S,
    PP,
    RECOVER_S,
    STEPS,
    TP,
    FaultStack,
    JobRun,
    compare_runs,
    wait_complete,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(2400)]

BROKERS = 3
#: Longest a ``publish`` call may take on the training thread. It is a put on a bounded queue: microseconds,
#: milliseconds when the interpreter is busy; a publisher that waited for the broker would take the seconds of
#: a fail-over (a dead broker is fenced after its 4 s session).
PUBLISH_BUDGET_S = 0.5
#: p99 of ``publish`` during a fail-over, well under the budget.
P99_BUDGET_S = 0.05
#: The rolling restart takes ~3 x (restart + catching up): published slower so it happens while the job runs.
ROLLING_PACE_S = 1.0


def _free_block(n: int) -> int:
    """A port P with P..P+n-1 all free on loopback."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


class ClusterStack(FaultStack):
    """The fault suite's private stack on a 3-broker cluster (``ARGUS_BROKERS=3``)."""

    def __init__(self, home: Path) -> None:
        super().__init__(home)
        bootstrap = os.environ.get("ARGUS_TEST_CLUSTER_BOOTSTRAP") or f"127.0.0.1:{_free_block(2 * BROKERS)}"
        self.env.update({"ARGUS_BROKERS": str(BROKERS), "ARGUS_BOOTSTRAP_SERVERS": bootstrap})
        self.settings = Settings.load(env=self.env)
        self.cluster = KafkaCluster(self.settings)

    def node_pid(self, node_id: int) -> int:
        pid = self.cluster.node(node_id).pid()
        assert pid is not None, f"kafka node {node_id} is not running:\n{self.logs()}"
        return pid

    def wait_node_back(self, node_id: int, old_pid: int, timeout_s: float = RECOVER_S) -> float:
        """Wait until the supervisor replaced node ``node_id``'s ``old_pid`` by a healthy node and every partition
        is fully in sync again; returns the seconds waited."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        node = self.cluster.node(node_id)
        while time.monotonic() < deadline:
            pid = node.pid()
            if pid is not None and pid != old_pid and node.is_healthy():
                try:
                    if self.cluster.under_replicated() == 0:
                        return time.monotonic() - t0
                except Exception:  # a node briefly not answering metadata: ask again
                    pass
            time.sleep(0.5)
        raise AssertionError(f"kafka node {node_id} not back and in sync within {timeout_s:.0f} s after "
                             f"pid {old_pid}:\n{self.logs()}")

    def logs(self) -> str:
        tails = []
        for n in self.cluster.nodes:
            if n.log_path.exists():
                lines = n.log_path.read_text(errors="replace").splitlines()
                tails.append(f"--- {n.log_path}\n" + "\n".join(x for x in lines[-400:] if " ERROR " in x)[-1500:])
        return super().logs() + "\n" + "\n".join(tails)


class TimedPublisher:
    """The rank-side :class:`Publisher` (never waits: drops and counts instead), each ``publish`` timed as the
    training thread sees it (monotonic ns of the call, its duration in ns)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.calls: list[tuple[int, int]] = []

    def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
        t0 = time.perf_counter_ns()
        sent = self.publisher.publish(topic, key, record)
        self.calls.append((t0, time.perf_counter_ns() - t0))
        return sent

    def flush(self, timeout_s: float = 30.0) -> int:
        return self.publisher.flush(timeout_s)


@dataclass
class FaultRun:
    run: JobRun
    calls: list[tuple[int, int]]
    #: perf_counter ns spans during which the cluster was disturbed.
    disturbed: list[tuple[int, int]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def latencies_ms(self) -> list[float]:
        """``publish`` durations (ms) of the calls made while disturbed (all calls when never disturbed)."""
        spans = self.disturbed or [(0, 2**63)]
        return [d / 1e6 for t, d in self.calls if any(a <= t <= b for a, b in spans)]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def publish_timed(stack: ClusterStack, job: str, on_step: dict[int, Callable[[], None]] | None = None,
                  pace_s: float = PACE_S) -> FaultRun:
    """Publish the suite's job (same spec and seed as every run) through a training-like publisher, ``pace_s``
    host seconds per step, ``on_step[n]()`` after step ``n`` is queued."""
    actions = on_step or {}
    sim = JobSimulator(build_spec(job, DP, TP, PP, STEPS, FAULT), batch_events=stack.settings.publisher_batch_events)

    def progress(done: int, _total: int) -> None:
        if done in actions:
            actions[done]()
        time.sleep(pace_s)

    pub = Publisher(stack.settings)
    timed = TimedPublisher(pub)
    try:
        stats = sim.run(timed, progress=progress, flush_timeout_s=RECOVER_S)
    finally:
        pstats = pub.close(timeout_s=RECOVER_S)
    assert not pstats.dropped and not pstats.failed and not pstats.encode_errors, f"publishing {job}: {pstats}"
    return FaultRun(JobRun(job, stats.kernel_events, stats.steps, stats.phase_batches), timed.calls)


TABLE: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    stack = ClusterStack(tmp_path_factory.mktemp("cluster") / "home")
    try:
        stack.up()
        yield stack
    finally:
        stack.down()
        left = [n.node.node_id for n in stack.cluster.nodes if n.pid() is not None]
        _write_table()
        assert not left, f"argus down left kafka nodes {left} running"


def _write_table() -> None:
    head = ("| scenario | events published | events summarized | duplicate rows | findings equal "
            "| p99 publish latency ms | max publish latency ms | calls timed | fail-over s | back in sync s |")
    rows = [head, "|" + "---|" * 10]
    rows += [f"| {r['scenario']} | {r['published']} | {r['summarized']} | {r['duplicates']} | "
             f"{'yes' if r['findings_equal'] else 'NO'} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} | {r['calls']} | "
             f"{r.get('failover_s', '-')} | {_back(r)} |" for r in TABLE]
    text = "\n".join(rows) + "\n"
    print("\n" + text)
    out = os.environ.get("ARGUS_FAULT_TABLE")
    if out:
        Path(out).write_text(text)


def _back(row: dict[str, Any]) -> str:
    """Seconds from the fault to the node back in every ISR (each restart's, for the rolling restart)."""
    if "restarts" in row:
        return " / ".join(str(r["back_in_sync_s"]) for r in row["restarts"])
    return str(row.get("back_in_sync_s", "-"))


@pytest.fixture(scope="module")
def cluster_clean(cluster_stack: ClusterStack) -> tuple[FaultRun, dict[str, Any]]:
    """The job undisturbed on the cluster, and what the store holds of it."""
    clean = publish_timed(cluster_stack, f"cclean-{uuid.uuid4().hex[:6]}")
    diagnosed, facts = wait_complete(cluster_stack, clean.run.job)
    assert diagnosed, f"clean job not diagnosed: {facts}\n{cluster_stack.logs()}"
    assert facts["kernel_events"] == clean.run.kernel_events and facts["findings"] > 0, facts
    assert all(facts[k] == 0 for k in DUPLICATE_FACTS), facts
    _record("undisturbed", clean, facts, facts)
    return clean, facts


def _record(scenario: str, fault: FaultRun, facts: dict[str, Any], expect: dict[str, Any]) -> dict[str, Any]:
    lat = fault.latencies_ms()
    row = {"scenario": scenario, "published": fault.run.kernel_events, "summarized": facts["kernel_events"],
           "duplicates": sum(facts[k] for k in DUPLICATE_FACTS),
           "findings_equal": facts["finding_ids"] == expect["finding_ids"], "p99_ms": _p99(lat),
           "max_ms": max(lat, default=float("nan")), "calls": len(lat), **fault.notes}
    TABLE.append(row)
    print(json.dumps(row))
    return row


def _check(stack: ClusterStack, scenario: str, fault: FaultRun, clean: tuple[FaultRun, dict[str, Any]]) -> None:
    clean_run, expect = clean
    facts = compare_runs(stack, fault.run, clean_run.run, expect, scenario, fault.notes)
    row = _record(scenario, fault, facts, expect)
    assert row["published"] == row["summarized"] and row["duplicates"] == 0 and row["findings_equal"], row
    assert row["calls"] > 0, "no publish call fell in the disturbed span"
    assert row["max_ms"] <= PUBLISH_BUDGET_S * 1e3 and row["p99_ms"] <= P99_BUDGET_S * 1e3, row


def _kill_after(stack: ClusterStack, fault: dict[str, Any], pick: Callable[[], int],
                moved: Callable[[int], bool]) -> Callable[[], None]:
    """An ``on_step`` action: kill -9 the node ``pick()`` names, noting which and when; a thread then waits (off
    the publishing thread) until ``moved(node)`` says its role went to another node, noting how long it took."""

    def watch(node_id: int, t0: float) -> None:
        deadline = t0 + RECOVER_S
        while time.monotonic() < deadline:
            try:
                if moved(node_id):
                    fault["failover_s"] = round(time.monotonic() - t0, 1)
                    return
            except Exception:  # metadata briefly unavailable during the election: ask again
                pass
            time.sleep(0.1)

    def kill() -> None:
        node_id = pick()
        pid = stack.node_pid(node_id)
        fault.update(node=node_id, pid=pid, at=time.perf_counter_ns())
        os.kill(pid, signal.SIGKILL)
        fault["watcher"] = threading.Thread(target=watch, args=(node_id, time.monotonic()), daemon=True)
        fault["watcher"].start()

    return kill


def _broker_status(stack: ClusterStack, node_id: int) -> dict[str, Any]:
    return next(b for b in stack.status()["kafka"]["brokers"] if b["node_id"] == node_id)


def _restarts(stack: ClusterStack) -> dict[int, int]:
    """Node id -> restarts, as ``argus status`` shows them."""
    return {b["node_id"]: b["restarts"] for b in stack.status()["kafka"]["brokers"]}


def _kernel_leader(stack: ClusterStack) -> int:
    leaders = list(stack.cluster.partition_leaders(Topic.KERNELS.full(stack.settings)).values())
    return max(set(leaders), key=leaders.count)


def _active_controller(stack: ClusterStack) -> int:
    node = stack.cluster.active_controller()
    assert node is not None, "no active KRaft controller known"
    return node


def test_status_shows_each_broker_and_supervises_them(cluster_stack: ClusterStack) -> None:
    doc = cluster_stack.status()
    kafka = doc["kafka"]
    assert kafka["healthy"] and len(kafka["brokers"]) == BROKERS
    assert [b["name"] for b in kafka["brokers"]] == ["kafka-1", "kafka-2", "kafka-3"]
    assert all(b["supervised"] and b["state"] == "running" and b["healthy"] for b in kafka["brokers"])
    assert kafka["controller"] in (1, 2, 3)
    text = cluster_stack.argus("status").stdout
    assert all(f"kafka-{i}" in text for i in (1, 2, 3)) and "active controller" in text
    # Topics (and the consumer offsets) replicated 3 times, 2 in sync required.
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": cluster_stack.settings.bootstrap_servers})
    md = admin.list_topics(timeout=30)
    kernels = md.topics[Topic.KERNELS.full(cluster_stack.settings)]
    assert all(len(p.replicas) == BROKERS for p in kernels.partitions.values())
    assert all(len(p.replicas) == BROKERS for p in md.topics["__consumer_offsets"].partitions.values())
    res = ConfigResource(ConfigResource.Type.TOPIC, Topic.KERNELS.full(cluster_stack.settings))
    config = admin.describe_configs([res])[res].result(30)
    assert config["min.insync.replicas"].value == "2"


@pytest.mark.parametrize("scenario", ["kill9-kernels-leader", "kill9-active-controller"])
def test_kill9_of_a_broker_while_publishing(scenario: str, cluster_stack: ClusterStack,
                                            cluster_clean: tuple[FaultRun, dict[str, Any]]) -> None:
    stack = cluster_stack
    stack.wait_all_healthy()
    assert stack.cluster.under_replicated() == 0
    fault: dict[str, Any] = {}
    restarts_before = _restarts(stack)
    kernels = Topic.KERNELS.full(stack.settings)
    leader = scenario == "kill9-kernels-leader"

    def pick() -> int:
        return _kernel_leader(stack) if leader else _active_controller(stack)

    def moved(node: int) -> bool:
        """The killed node leads no kernel partition / is no longer the active controller."""
        if leader:
            return node not in stack.cluster.partition_leaders(kernels).values()
        return stack.cluster.active_controller() not in (None, node)

    before = pick()
    run = publish_timed(stack, f"{scenario[:12]}-{uuid.uuid4().hex[:6]}",
                        on_step={8: _kill_after(stack, fault, pick, moved)})
    assert fault, "the kill did not happen"
    fault["watcher"].join(RECOVER_S)
    assert "failover_s" in fault, f"{scenario}: the killed node's role did not move to another node"
    stack.wait_node_back(fault["node"], fault["pid"])
    back_at = time.perf_counter_ns()
    run.disturbed = [(fault["at"], back_at)]
    back_s = (back_at - fault["at"]) / 1e9
    # The partitions and the quorum moved away from the killed node while it was down.
    run.notes = {"killed_node": fault["node"], "node_at_start": before, "failover_s": fault["failover_s"],
                 "back_in_sync_s": round(back_s, 1)}
    # The supervisor brought the node back (nobody ran argus up) and says so.
    broker = _broker_status(stack, fault["node"])
    # A node that argus up started (adopted by the supervisor, not its child) exits with no status to read.
    assert broker["last_exit"] is not None and broker["last_exit"]["signal"] in (None, "SIGKILL"), broker
    assert _restarts(stack) == {**restarts_before, fault["node"]: restarts_before[fault["node"]] + 1}
    _check(stack, scenario, run, cluster_clean)


def test_rolling_restart_of_all_brokers_during_a_job(cluster_stack: ClusterStack,
                                                     cluster_clean: tuple[FaultRun, dict[str, Any]]) -> None:
    stack = cluster_stack
    stack.wait_all_healthy()
    assert stack.cluster.under_replicated() == 0
    spans: list[tuple[int, int]] = []
    restarts: list[dict[str, Any]] = []
    restarts_before = _restarts(stack)
    errors: list[BaseException] = []

    def roll() -> None:
        try:
            for node in stack.cluster.nodes:
                node_id = node.node.node_id
                pid = stack.node_pid(node_id)
                t0 = time.perf_counter_ns()
                os.kill(pid, signal.SIGTERM)  # a controlled shutdown; the supervisor starts it again
                stack.wait_node_back(node_id, pid)
                spans.append((t0, time.perf_counter_ns()))
                restarts.append({"node": node_id, "back_in_sync_s": round((spans[-1][1] - t0) / 1e9, 1)})
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    roller = threading.Thread(target=roll, name="rolling-restart", daemon=True)
    run = publish_timed(stack, f"rolling-{uuid.uuid4().hex[:6]}", on_step={4: roller.start}, pace_s=ROLLING_PACE_S)
    roller.join(3 * RECOVER_S)
    assert not roller.is_alive() and not errors, (errors, restarts)
    assert [r["node"] for r in restarts] == [1, 2, 3], restarts
    run.disturbed = spans
    run.notes = {"restarts": restarts}
    assert _restarts(stack) == {n: r + 1 for n, r in restarts_before.items()}, "each broker restarted once"
    _check(stack, "rolling-restart", run, cluster_clean)
