"""``argus replay``: a retained job diagnosed again, with the current detectors, into a namespace of its own.

A postmortem asks "what would argus say about that job now?" (after a detector change, with other settings, or
just to check). :func:`replay_job` answers it with the same code that ran live, not a re-implementation:
see docs/internals/application.md.
"""

from __future__ import annotations

import datetime
import logging
import math
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from argus.core.errors import ArgusError
from argus.core.kafka_security import client_config, producer_config
from argus.core.settings import Settings
from argus.progress import Advance
from argus.schemas.records import JobLifecycle, LifecycleEvent
from argus.topics import PARTITIONER, Topic, ensure_topics

__all__ = ["FindingsDiff", "ReplayResult", "copy_job_records", "diff_findings", "finding_identity",
           "namespace_settings", "parse_time_ms", "replay_job"]

log = logging.getLogger(__name__)

#: The job's own input topics, in the order they are copied (context first, then the records it frames).
INPUT_TOPICS = (Topic.TOPOLOGY, Topic.LIFECYCLE, Topic.STEPS, Topic.PHASES, Topic.HEARTBEATS, Topic.KERNELS)
#: Copied whatever the time range: what frames the job rather than measures it.
_ALWAYS = frozenset({Topic.TOPOLOGY})
#: Lifecycle events the job itself publishes (the others are argus's own).
_JOB_EVENTS = frozenset({LifecycleEvent.START, LifecycleEvent.END})
_NAMESPACE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: Relative difference of score or impact under which a finding counts as unchanged (float noise).
_REL_TOL = 1e-9
#: A replayed job without an END (a crashed job, or a time range that cut it) is closed this long after its
#: last record, instead of the live idle timeout.
_REPLAY_IDLE_S = 20.0


def namespace_settings(settings: Settings, namespace: str) -> Settings:
    """The settings of replay namespace ``namespace`` beside the live ``settings``.

    Topics ``<prefix><namespace>.<name>``, consumer groups ``<group>-<namespace>``, the ClickHouse database
    ``namespace`` (embedded chDB: in ``<home>/replay/<namespace>/chdb``), state under
    ``<home>/replay/<namespace>``, free loopback ports for its worker and SQL endpoint; Kafka and every
    detector setting as live.

    Raises:
        ArgusError: ``namespace`` is not a letter or ``_`` followed by up to 62 letters, digits or ``_``, or it
            is the live database's name.
    """
    if not _NAMESPACE.fullmatch(namespace):
        raise ArgusError(f"replay namespace must be a letter or _ followed by up to 62 letters, digits or _, "
                         f"got {namespace!r}")
    if namespace == settings.clickhouse_database:
        raise ArgusError(f"replay namespace {namespace!r} is the live database's name; choose another")
    home = settings.home / "replay" / namespace
    changes: dict[str, Any] = {
        "topic_prefix": f"{settings.topic_prefix}{namespace}.", "app_id": f"{settings.app_id}-{namespace}",
        "sink_group": f"{settings.sink_group}-{namespace}", "clickhouse_database": namespace, "home": home,
        "query_port": _free_port(), "worker_web_port": _free_port(),
        "job_idle_timeout_s": min(settings.job_idle_timeout_s, _REPLAY_IDLE_S),
        "sink_metrics_port": 0,  # a replay is not scraped
    }
    if settings.chdb_path is not None:
        changes["clickhouse_dsn"] = f"chdb://{(home / 'chdb').resolve()}"
    return settings.replace(**changes)


def parse_time_ms(text: str) -> int:
    """``text`` as milliseconds since the Unix epoch: ISO 8601 (``2026-12-01T10:00:00Z``; without a zone,
    UTC) or a number of seconds since the epoch. Raises :class:`ArgusError` otherwise."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError as exc:
            raise ArgusError(f"not a time (ISO 8601 or seconds since the epoch): {text!r}") from exc
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp()
    if not math.isfinite(seconds) or seconds < 0:
        raise ArgusError(f"time out of range: {text!r}")
    return int(seconds * 1000)


def _belongs(key: bytes | None, job: bytes) -> bool:
    return key is not None and (key == job or key.startswith(job + b"/"))


def _job_record(topic: Topic, value: bytes) -> bool:
    """False for the lifecycle records argus writes itself (DIAGNOSED, ABANDONED)."""
    if topic is not Topic.LIFECYCLE:
        return True
    try:
        return JobLifecycle.decode(value).event in _JOB_EVENTS
    except ArgusError:
        return True  # copied as it is: the replay dead-letters it as the live run did


def copy_job_records(source: Settings, target: Settings, job_id: str, from_ms: int | None = None,
                     to_ms: int | None = None, advance: Advance | None = None,
                     timeout_s: float = 60.0) -> dict[str, int]:
    """Copy job ``job_id``'s input records from ``source``'s topics into ``target``'s; returns the messages
    copied per logical topic.

    Each topic is read from its start (or the first offset at ``from_ms``, ms since the epoch) to its end as of
    the call, keeping messages of the job (key ``<job>`` or ``<job>/...``) published before ``to_ms``; each is
    produced with its key, value and timestamp (keys are partitioned as every argus producer does, so the job
    keeps one partition per topic and its order). ``advance(read, total)`` reports messages read.

    Raises:
        ArgusError: the broker cannot be reached, a topic is missing, or a copy is not delivered.
    """
    job = job_id.encode()
    consumer = Consumer(client_config(source.kafka, {"group.id": f"{source.app_id}-replay-reader",
                                               "enable.auto.commit": False, "auto.offset.reset": "earliest",
                                               "fetch.max.bytes": 64 << 20}))
    producer = Producer(producer_config(target.kafka, {"partitioner": PARTITIONER, "linger.ms": 20,
                                                 "compression.type": target.compression,
                                                 "message.max.bytes": 16 << 20}))
    failed: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    copied: dict[str, int] = {}
    try:
        plan = {t: _plan(consumer, t.full(source), None if t in _ALWAYS else from_ms, timeout_s)
                for t in INPUT_TOPICS}
        total = sum(hi - lo for ranges in plan.values() for lo, hi in ranges.values())
        read = 0
        for topic, ranges in plan.items():
            n = 0
            for msg in _read(consumer, topic.full(source), ranges, timeout_s):
                read += 1
                if advance is not None and read % 1000 == 0:
                    advance(read, total)
                key, value = msg.key(), msg.value() or b""
                if not _belongs(key, job) or not _job_record(topic, value):
                    continue
                stamp = msg.timestamp()[1]
                if to_ms is not None and topic not in _ALWAYS and stamp > to_ms:
                    continue
                while True:
                    try:
                        producer.produce(topic.full(target), key=key, value=value, on_delivery=delivered,
                                         **({"timestamp": stamp} if stamp > 0 else {}))
                        break
                    except BufferError:
                        producer.poll(0.1)
                producer.poll(0)
                n += 1
            copied[topic.value] = n
        if advance is not None:
            advance(read, total)
        left = producer.flush(timeout_s)
    except KafkaException as exc:
        raise ArgusError(f"replay of {job_id}: cannot read or write Kafka ({exc})") from exc
    finally:
        consumer.close()
    if left or failed:
        raise ArgusError(f"replay of {job_id}: {left} copies not delivered, {len(failed)} failed"
                         + (f" ({failed[0]})" if failed else ""))
    return copied


def _plan(consumer: Consumer, topic: str, from_ms: int | None, timeout_s: float) -> dict[int, tuple[int, int]]:
    """Partition -> (first offset to read, end offset) of ``topic`` as of now."""
    meta = consumer.list_topics(topic, timeout=timeout_s)
    if topic not in meta.topics or meta.topics[topic].error is not None:
        raise ArgusError(f"topic {topic} not found on the broker: nothing retained to replay")
    out: dict[int, tuple[int, int]] = {}
    parts = sorted(meta.topics[topic].partitions)
    starts: dict[int, int] = {}
    if from_ms is not None:
        found = consumer.offsets_for_times([TopicPartition(topic, p, from_ms) for p in parts], timeout=timeout_s)
        starts = {tp.partition: tp.offset for tp in found}
    for p in parts:
        lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
        start = starts.get(p, lo)
        start = hi if start < 0 else max(start, lo)  # -1: nothing at or after from_ms
        if hi > start:
            out[p] = (start, hi)
    return out


def _read(consumer: Consumer, topic: str, ranges: dict[int, tuple[int, int]], timeout_s: float) -> Iterable[Any]:
    """The messages of ``topic`` in ``ranges`` (partition -> [start, end) offsets)."""
    if not ranges:
        return
    consumer.assign([TopicPartition(topic, p, lo) for p, (lo, _hi) in ranges.items()])
    open_parts = set(ranges)
    quiet_since = time.monotonic()
    try:
        while open_parts:
            msgs = consumer.consume(num_messages=2000, timeout=0.5)
            if msgs:
                quiet_since = time.monotonic()
            for msg in msgs:
                if msg.error() is not None:
                    continue
                p, offset = msg.partition(), msg.offset()
                if p in open_parts and offset is not None and offset < ranges[p][1]:
                    yield msg
            for tp in consumer.position([TopicPartition(topic, p) for p in open_parts]):
                # Offsets may have gaps (compaction, transaction markers): the position says where reading is.
                if tp.offset >= ranges[tp.partition][1]:
                    open_parts.discard(tp.partition)
            if open_parts and time.monotonic() - quiet_since > timeout_s:
                raise ArgusError(f"reading {topic}: partitions {sorted(open_parts)} gave nothing for "
                                 f"{timeout_s:.0f} s before their end")
    finally:
        consumer.unassign()


def finding_identity(f: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two findings (``argus findings --json`` objects) the same finding: what ``finding_id`` hashes."""
    return (f["level"], f["kind"], tuple(f["ranks"]), f["phase"], f["kernel"], f["stream"], tuple(f["steps"]))


@dataclass(frozen=True)
class FindingsDiff:
    """Live findings against replayed ones: only in one of them, or in both with another score or impact."""

    only_live: tuple[dict[str, Any], ...] = ()
    only_replay: tuple[dict[str, Any], ...] = ()
    #: (live, replayed) pairs of the same finding whose score or impact differ.
    changed: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()
    same: int = 0

    @property
    def identical(self) -> bool:
        return not (self.only_live or self.only_replay or self.changed)

    def as_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, "same": self.same, "only_live": list(self.only_live),
                "only_replay": list(self.only_replay),
                "changed": [{"live": a, "replay": b} for a, b in self.changed]}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-9)


def diff_findings(live: Iterable[dict[str, Any]], replayed: Iterable[dict[str, Any]]) -> FindingsDiff:
    """Compare two lists of findings (the ``argus findings --json`` contract) by :func:`finding_identity`.

    A finding in both counts as changed when its score, ``impact_ns`` or ``impact_ns_per_step`` differ (beyond
    float noise); its evidence, time and ``detector_version`` are not compared.
    """
    a = {finding_identity(f): f for f in live}
    b = {finding_identity(f): f for f in replayed}
    changed = []
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if not all(_close(float(x[n]), float(y[n])) for n in ("score", "impact_ns", "impact_ns_per_step")):
            changed.append((x, y))
    order = sorted  # deterministic output: identities are tuples of plain values
    return FindingsDiff(only_live=tuple(a[k] for k in order(a.keys() - b.keys(), key=repr)),
                        only_replay=tuple(b[k] for k in order(b.keys() - a.keys(), key=repr)),
                        changed=tuple(sorted(changed, key=lambda p: repr(finding_identity(p[0])))),
                        same=len(a.keys() & b.keys()) - len(changed))


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay_job` did and found."""

    job_id: str
    namespace: str
    #: Messages copied per logical topic.
    copied: dict[str, int]
    live: list[dict[str, Any]]
    replayed: list[dict[str, Any]]
    diff: FindingsDiff
    #: Whether the replayed job was diagnosed through to the namespace's tables before the timeout.
    complete: bool
    settings: Settings = field(repr=False)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        versions = sorted({f.get("detector_version", "") for f in self.replayed})
        return {"job": self.job_id, "namespace": self.namespace, "complete": self.complete, "copied": self.copied,
                "live_findings": len(self.live), "replayed_findings": len(self.replayed),
                "detector_versions": {"live": sorted({f.get("detector_version", "") for f in self.live}),
                                      "replay": versions},
                "diff": self.diff.as_dict(), "database": self.settings.clickhouse_database,
                "topic_prefix": self.settings.topic_prefix, "wall_s": round(self.wall_s, 1)}


def replay_job(settings: Settings, job_id: str, namespace: str | None = None, from_ms: int | None = None,
               to_ms: int | None = None, timeout_s: float = 600.0, progress: Callable[[str], None] | None = None,
               advance: Advance | None = None) -> ReplayResult:
    """Replay job ``job_id`` into ``namespace`` (default ``replay_<UTC time>``) and compare its findings with
    the stored live ones (see the module docstring). ``from_ms``/``to_ms``: only records published in that
    span (ms since the epoch; the topology always). ``timeout_s``: how long to wait for the replayed diagnosis.

    Raises:
        ArgusError: a bad namespace or time range, the job has no retained records, Kafka or ClickHouse cannot
            be reached, or the namespace's worker or sink does not start.
    """
    from argus.sinks.findings_query import fetch_findings, wait_diagnosed
    from argus.stack import Stack

    say = progress or (lambda _m: None)
    if from_ms is not None and to_ms is not None and from_ms > to_ms:
        raise ArgusError(f"--from-time is after --to-time ({from_ms} > {to_ms} ms)")
    t0 = time.monotonic()
    ns = namespace or "replay_" + datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    target = namespace_settings(settings, ns)
    live = fetch_findings(settings, job_id)
    say(f"replay of {job_id} into namespace {ns}: {len(live)} live finding(s) stored")
    ensure_topics(target)
    copied = copy_job_records(settings, target, job_id, from_ms, to_ms, advance=advance)
    say(f"copied {sum(copied.values()):,} message(s): " + ", ".join(f"{k} {v:,}" for k, v in copied.items()))
    if not any(copied.get(t.value) for t in (Topic.KERNELS, Topic.STEPS, Topic.PHASES)):
        raise ArgusError(f"job {job_id}: no retained kernels, steps or phases"
                         + (" in that time range" if from_ms is not None or to_ms is not None else "")
                         + f" on {settings.topic_prefix}* (retention {settings.retention_ms / 3.6e6:.0f} h)")
    stack = Stack(target)
    try:
        stack.up(progress=lambda m: say(f"[{ns}] {m}"))
        say("waiting for the replayed diagnosis")
        complete = wait_diagnosed(target, job_id, timeout_s)
        replayed = fetch_findings(target, job_id)
    finally:
        stack.down(keep_kafka=True)
    return ReplayResult(job_id, ns, copied, live, replayed, diff_findings(live, replayed), complete, target,
                        time.monotonic() - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
