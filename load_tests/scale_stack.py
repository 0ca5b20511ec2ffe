"""What the through-the-stack scale benchmarks share (``e2e_scale``, ``summary_scale``, ``realtime``): a private
stack started for one run with the worker's memory sampled, and the broker's times of a job's messages.

Nothing here judges a budget: each benchmark says what it measures and what it allows.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, TopicPartition
from detection_eval import PrivateStack
from soak import RssSampler

from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.topics import RECORD_OF, Topic

__all__ = ["PrivateStack", "RssSampler", "load_average", "running_stack", "topic_record", "topic_times"]


@contextmanager
def running_stack(prefix: str, sample_s: float, partitions: int = 4,
                  env: dict[str, str] | None = None) -> Iterator[tuple[PrivateStack, Settings, RssSampler]]:
    """``argus up`` of a private stack (home under a fresh temporary folder named ``prefix``, its own ports,
    topics and groups; ``env``: further ``ARGUS_*`` settings for every service), this process's settings
    pointed at it, and the worker's resident memory sampled every ``sample_s`` s; the stack is taken down on
    leaving, whatever happened, and its folder removed (kept, and named on stderr, where the run failed: its
    services' logs are there)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    stack = PrivateStack(work / "home", partitions=partitions)
    stack.env.update(env or {})
    sampler = RssSampler(stack.home, "worker", sample_s)
    done = False
    try:
        stack.up()
        os.environ.update({k: v for k, v in stack.env.items() if k.startswith("ARGUS_")})
        with sampler:
            yield stack, Settings.load(), sampler
        done = True
    finally:
        stack.down()
        if done:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"private stack kept for its logs: {work}", file=sys.stderr)


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (how busy it was while a figure was taken)."""
    return [round(x, 2) for x in os.getloadavg()]


def topic_times(settings: Settings, topic: Topic, job: str, decode: bool = False) -> list[tuple[int, Any]]:
    """The (broker-stamped creation time in ms, record or None) of every message of ``job`` (keys ``job`` or
    ``job/...``) on ``topic``, read from its start to its end now; records decoded where ``decode``."""
    name = topic.full(settings)
    consumer = Consumer(client_config(settings.kafka, {"group.id": f"{settings.app_id}-e2e-times",
                                                       "enable.auto.commit": False}))
    out: list[tuple[int, Any]] = []
    try:
        parts = consumer.list_topics(name, timeout=30).topics[name].partitions
        ends = {}
        for p in parts:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=30)
            if hi > lo:
                ends[p] = (lo, hi)
        consumer.assign([TopicPartition(name, p, lo) for p, (lo, _) in ends.items()])
        left = {p: hi for p, (_, hi) in ends.items()}
        deadline = time.monotonic() + 300
        prefix = f"{job}/".encode()
        while left and time.monotonic() < deadline:
            for msg in consumer.consume(10_000, 1.0):
                if msg.error() is not None:
                    continue
                key = msg.key() or b""
                if key == job.encode() or key.startswith(prefix):
                    rec = topic_record(topic, msg.value()) if decode else None
                    out.append((msg.timestamp()[1], rec))
                if (msg.offset() or 0) >= left.get(msg.partition() or 0, 0) - 1:
                    left.pop(msg.partition() or 0, None)
    finally:
        consumer.close()
    return out


def topic_record(topic: Topic, value: bytes | None) -> Any:
    try:
        return RECORD_OF[topic].decode(value or b"")
    except Exception:  # a stage breakdown only: an undecodable message is not a stage's end
        return None
