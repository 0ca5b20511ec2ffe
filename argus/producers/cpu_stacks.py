"""Host-side Python stacks for findings: py-spy dumps of the rank processes a finding names.

The host channel of ARGUS (§4): when a detector publishes a :class:`~argus.schemas.records.Finding` naming ranks,
the :class:`StackCollector` running on each training host (``argus`` CLI, one per host) dumps the Python stacks
of those ranks that run *on that host* and publishes them as :class:`~argus.schemas.records.CpuStack` records on
``Topic.STACKS`` (key ``<job>/<rank>``; sink table ``cpu_stacks``).

Flow: findings topic (own consumer group per host, from the latest offset: only new findings matter) ->
:meth:`StackCapturer.handle` -> for each named rank: local :class:`~argus.producers.rank_registry.RankRegistry` entry
(written by the rank's :class:`~argus.producers.tracer.Tracer`) -> same process still alive (pid + start time) ->
not captured yet for this (job, rank, finding) -> rate limit -> ``py-spy dump --pid <pid> --json`` ->
CpuStack -> publisher.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import collections
import json
import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argus.core.errors import ProducerError, SchemaError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.producers.rank_registry import RankRegistry
from argus.schemas.records import CpuStack, Finding
from argus.topics import PublisherLike, Topic, rank_key

__all__ = ["StackCaptureError", "StackCapturer", "StackCollector", "capture_stacks", "find_py_spy"]

log = logging.getLogger(__name__)

_PERMISSION_HINTS = ("permission denied", "operation not permitted", "ptrace", "eperm", "access denied")
_MAX_RANK = 1 << 24


class StackCaptureError(ProducerError):
    """py-spy could not dump a process; ``permission`` tells a missing ptrace permission apart."""

    def __init__(self, message: str, permission: bool = False) -> None:
        super().__init__(message)
        self.permission = permission


def find_py_spy() -> str | None:
    """The py-spy executable: on ``PATH``, else next to this Python interpreter (a virtualenv's ``bin``)."""
    found = shutil.which("py-spy")
    if found:
        return found
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.is_file() else None


def capture_stacks(pid: int, *, py_spy: str | None = None, timeout_s: float = 20.0, nonblocking: bool = False
                   ) -> str:
    """``py-spy dump --pid <pid> --json`` of a live process; returns the JSON text (an array of threads).

    ``nonblocking`` does not pause the target (cheaper for it, stacks may be torn).

    Raises:
        StackCaptureError: bad pid, no py-spy, timeout, py-spy failure (``permission=True`` when ptrace was
            refused) or output that is not a JSON array.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise StackCaptureError(f"invalid pid {pid!r}")
    exe = py_spy or find_py_spy()
    if exe is None:
        raise StackCaptureError("py-spy is not installed (pip install py-spy)")
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if nonblocking:
        cmd.append("--nonblocking")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, shell=False)
    except subprocess.TimeoutExpired as exc:
        raise StackCaptureError(f"py-spy dump of pid {pid} timed out after {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise StackCaptureError(f"cannot run py-spy ({exe}): {exc}") from exc
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        first = next((ln for ln in err if ln.strip() and not ln.lstrip()[:1].isdigit()), "no output")
        low = (proc.stderr or "").lower()
        if any(h in low for h in _PERMISSION_HINTS):
            raise StackCaptureError(
                f"py-spy may not ptrace pid {pid}: {first} (run the collector as root or with CAP_SYS_PTRACE, "
                f"or set kernel.yama.ptrace_scope=0)", permission=True)
        raise StackCaptureError(f"py-spy dump of pid {pid} failed (exit {proc.returncode}): {first}")
    try:
        parsed = json.loads(proc.stdout)
    except ValueError as exc:
        raise StackCaptureError(f"py-spy printed no JSON for pid {pid}: {exc}") from exc
    if not isinstance(parsed, list):
        raise StackCaptureError(f"py-spy JSON for pid {pid} is not an array of threads")
    return proc.stdout


@dataclass
class _Limiter:
    """At most ``burst`` captures, refilled at ``per_minute`` a minute (token bucket)."""

    per_minute: float
    burst: int
    tokens: float = 0.0
    at: float = 0.0

    def take(self, now: float) -> bool:
        if not self.at:
            self.tokens, self.at = float(self.burst), now
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.per_minute / 60.0)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class StackCapturer:
    """Turns findings into CpuStack records for the ranks of this host (no Kafka; see :class:`StackCollector`).

    Args:
        registry: this host's rank registry.
        host: host name written on the records.
        per_minute, burst: rate limit of captures on this host.
        max_finding_age_s: findings whose ``time_ns`` is older are ignored (a replay must not dump
            processes whose state has long moved on); None to accept any age.
        capture: the capture function (``capture_stacks``; replaceable in tests).
    """

    def __init__(self, registry: RankRegistry | None = None, host: str | None = None, *, per_minute: float = 12.0,
                 burst: int = 8, max_finding_age_s: float | None = 900.0, py_spy: str | None = None,
                 capture: Any = None, remember: int = 10_000) -> None:
        self.registry = registry or RankRegistry()
        self.host = host or socket.gethostname()
        self._limiter = _Limiter(per_minute, burst)
        self._max_age_ns = None if max_finding_age_s is None else int(max_finding_age_s * 1e9)
        self._py_spy = py_spy
        self._capture = capture or capture_stacks
        self._seen: collections.OrderedDict[tuple[str, int, str], None] = collections.OrderedDict()
        self._remember = remember
        self.captured = self.rate_limited = self.failed = self.not_here = self.stale = 0
        self.last_error: StackCaptureError | None = None

    def handle(self, finding: Finding, now_ns: int | None = None) -> list[CpuStack]:
        """Capture the stacks of the finding's ranks that run on this host (each (job, rank, finding) once)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        if self._max_age_ns is not None and now_ns - finding.time_ns > self._max_age_ns:
            self.stale += 1
            return []
        out: list[CpuStack] = []
        for rank in finding.ranks:
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < _MAX_RANK:
                continue
            key = (finding.job_id, rank, finding.finding_id)
            if key in self._seen:
                continue
            entry = self.registry.lookup(finding.job_id, rank)
            if entry is None or not entry.alive():
                self.not_here += 1
                continue
            if not self._limiter.take(time.monotonic()):
                self.rate_limited += 1
                log.info("stack capture of %s/%d for finding %s rate-limited", finding.job_id, rank,
                         finding.finding_id)
                continue
            self._remember_key(key)
            t0 = time.time_ns()
            try:
                stacks = self._capture(entry.pid, py_spy=self._py_spy)
            except StackCaptureError as exc:
                self.failed += 1
                self.last_error = exc
                log.error("stack capture of %s rank %d (pid %d) failed: %s", finding.job_id, rank, entry.pid, exc)
                continue
            self.captured += 1
            out.append(CpuStack(job_id=finding.job_id, rank=rank, host=self.host, pid=entry.pid, time_ns=t0,
                                finding_id=finding.finding_id, stacks_json=stacks))
        return out

    def _remember_key(self, key: tuple[str, int, str]) -> None:
        self._seen[key] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)


class StackCollector:
    """Consumes the findings topic and publishes CpuStacks for this host's ranks (run one per host).

    Args:
        settings: Kafka settings.
        publisher: where CpuStacks go (default: a new :class:`~argus.producers.publisher.Publisher`).
        capturer: the capture logic (default: a :class:`StackCapturer` on the default registry).
        group_id: consumer group; default ``<app_id>-stacks-<host>`` so that every host sees every finding.
    """

    def __init__(self, settings: Settings, publisher: PublisherLike | None = None,
                 capturer: StackCapturer | None = None, group_id: str | None = None) -> None:
        self.settings = settings
        self.capturer = capturer or StackCapturer()
        if publisher is None:
            from argus.producers.publisher import Publisher
            publisher = Publisher(settings)
        self.publisher = publisher
        self.group_id = group_id or f"{settings.app_id}-stacks-{self.capturer.host}"
        self.published = self.undecodable = 0

    def process(self, payload: bytes) -> list[CpuStack]:
        """Handle one findings-topic message value; publishes and returns the captured stacks."""
        try:
            finding = Finding.decode(payload)
        except SchemaError as exc:
            self.undecodable += 1
            log.warning("undecodable finding ignored: %s", exc)
            return []
        stacks = self.capturer.handle(finding)
        for st in stacks:
            if self.publisher.publish(Topic.STACKS, rank_key(st.job_id, st.rank), st):
                self.published += 1
        return stacks

    def run(self, stop: threading.Event | None = None, poll_s: float = 0.5) -> None:
        """Consume until ``stop`` is set (or forever). Raises :class:`ProducerError` if Kafka is unusable."""
        from confluent_kafka import Consumer, KafkaException

        try:
            consumer = Consumer(client_config(self.settings.kafka, {
                "group.id": self.group_id, "auto.offset.reset": "latest", "enable.auto.commit": True,
                "session.timeout.ms": int(self.settings.session_timeout_s * 1000),
            }))
            consumer.subscribe([Topic.FINDINGS.full(self.settings)])
        except KafkaException as exc:
            raise ProducerError(f"stack collector cannot consume findings: {exc}") from exc
        log.info("stack collector on %s: group %s, registry %s", self.capturer.host, self.group_id,
                 self.capturer.registry.directory)
        try:
            while stop is None or not stop.is_set():
                msg = consumer.poll(poll_s)
                if msg is None:
                    continue
                if msg.error():
                    log.warning("findings consumer: %s", msg.error())
                    continue
                self.process(msg.value() or b"")
                self.publisher.flush(0)
        finally:
            consumer.close()
            self.publisher.flush(10.0)
