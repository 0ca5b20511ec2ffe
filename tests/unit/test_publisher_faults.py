"""Faults on the rank side: no record kills the publisher's sender, and close() is bounded by its timeout in
every state of the sender (dead, stuck on a full Kafka queue, behind a full record queue)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from argus.core.settings import Settings
from argus.producers.publisher import Publisher, PublisherStats
from argus.topics import Topic
from tests.samples import kernel_batch

NO_BROKER: dict[str, Any] = {"message.timeout.ms": 100}


def settings(queue_max: int = 10) -> Settings:
    return Settings.load(env={}, bootstrap_servers="127.0.0.1:1", publisher_queue_max=queue_max)


class Raising:
    """A record whose encoding raises ``exc``."""

    rank = 3

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def encode(self) -> bytes:
        raise self.exc


def within(limit_s: float, fn: Any) -> Any:
    """``fn()`` in a helper thread; it must return within ``limit_s`` (a hang fails the test, not blocks it)."""
    out: list[Any] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(limit_s)
    assert out, f"still blocked after {time.monotonic() - t0:.1f} s"
    return out[0]


def close_within(pub: Publisher, timeout_s: float, slack_s: float = 1.5) -> PublisherStats:
    """close(timeout_s) must return within timeout_s + slack_s."""
    stats: PublisherStats = within(timeout_s + slack_s, lambda: pub.close(timeout_s))
    return stats


def wait_until(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    assert cond()


def test_any_exception_of_an_encoding_is_counted_logged_and_survived(caplog: pytest.LogCaptureFixture) -> None:
    pub = Publisher(settings(), extra_config=NO_BROKER)
    errors = [RuntimeError("boom"), OverflowError("int too big to convert"), KeyError("x"), RecursionError(),
              ZeroDivisionError(), MemoryError()]
    with caplog.at_level(logging.ERROR, logger="argus.producers.publisher"):
        for exc in errors:
            assert pub.publish(Topic.KERNELS, b"job/3", Raising(exc))
        wait_until(lambda: pub.stats().encode_errors == len(errors))
    assert pub._thread is not None and pub._thread.is_alive()
    stats = close_within(pub, 0.5)
    assert (stats.accepted, stats.encode_errors, stats.dropped, stats.queued) == (len(errors), len(errors), 0, 0)
    lines = [r.getMessage() for r in caplog.records]
    assert any("topic kernels" in m and "b'job/3'" in m and "rank 3" in m and "RuntimeError: boom" in m
               for m in lines), lines


def test_a_produce_that_raises_anything_is_counted_as_failed() -> None:
    pub = Publisher(settings(), extra_config=NO_BROKER)
    assert pub.publish(Topic.STEPS, 12345, kernel_batch())  # type: ignore[arg-type]  # not bytes: produce raises
    wait_until(lambda: pub.stats().failed == 1)
    assert pub._thread is not None and pub._thread.is_alive()
    assert close_within(pub, 0.5).failed >= 1


class Fatal(BaseException):
    """Nothing in the sender catches it: it stands for a sender thread that died."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("lossless", [False, True])
def test_close_is_bounded_when_the_sender_is_dead_and_the_queue_full(lossless: bool) -> None:
    pub = Publisher(settings(queue_max=3), extra_config=NO_BROKER, lossless=lossless)
    assert pub.publish(Topic.KERNELS, b"job/0", Raising(Fatal()))
    assert pub._thread is not None
    pub._thread.join(5)
    assert not pub._thread.is_alive()
    # Even lossless: nobody drains the queue any more, so publish drops instead of waiting forever.
    results = within(3.0, lambda: [pub.publish(Topic.KERNELS, b"job/0", kernel_batch()) for _ in range(5)])
    assert results == [True, True, True, False, False]
    stats = close_within(pub, 0.5)
    # The three left in the queue are given up at close and counted as failed, not left "queued" forever.
    assert (stats.dropped, stats.queued, stats.failed) == (2, 0, 3)
    assert pub.flush(0.5) == 0 and pub.close(0.1) == pub.stats()


class StuckProducer:
    """A Kafka producer whose queue is always full (a broker gone for good)."""

    def __init__(self) -> None:
        self.calls = 0

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        raise BufferError("Local: Queue full")

    def poll(self, timeout: float = 0) -> int:
        time.sleep(timeout)
        return 0

    def flush(self, timeout: float = 0) -> int:
        time.sleep(timeout)
        return 1

    def __len__(self) -> int:
        return 1


def test_close_is_bounded_when_the_sender_waits_on_a_full_kafka_queue() -> None:
    pub = Publisher(settings(queue_max=3), extra_config=NO_BROKER)
    stuck = StuckProducer()
    pub._producer = stuck  # type: ignore[assignment]
    results = [pub.publish(Topic.KERNELS, b"job/0", kernel_batch()) for _ in range(5)]
    wait_until(lambda: stuck.calls > 0)
    assert results.count(True) >= 3
    stats = close_within(pub, 0.5)
    assert pub._thread is not None
    pub._thread.join(1.0)
    assert not pub._thread.is_alive()  # the sender gave up its record and stopped
    assert stats.failed + pub.stats().failed >= 1


def test_a_delivery_callback_that_raises_does_not_reach_the_caller() -> None:
    pub = Publisher(settings(), extra_config=NO_BROKER)

    class Exploding(StuckProducer):
        def produce(self, *args: Any, **kwargs: Any) -> None:
            self.calls += 1

        def poll(self, timeout: float = 0) -> int:
            raise RuntimeError("callback failed")

        def flush(self, timeout: float = 0) -> int:
            raise RuntimeError("callback failed")

    pub._producer = Exploding()  # type: ignore[assignment]
    assert pub.publish(Topic.KERNELS, b"job/0", kernel_batch())
    wait_until(lambda: pub.stats().queued == 0 and pub._queue.unfinished_tasks == 0)
    assert pub._thread is not None and pub._thread.is_alive()
    assert pub.flush(0.2) == 1  # what the producer still holds
    close_within(pub, 0.5)


def test_after_close_every_accepted_record_is_delivered_or_counted_failed() -> None:
    """close() left 2,933 accepted records neither delivered nor counted: those librdkafka still held (no broker,
    a long message timeout) and those the sender never handed to it."""
    pub = Publisher(settings(queue_max=4096), extra_config={"message.timeout.ms": 60_000})
    accepted = sum(pub.publish(Topic.KERNELS, b"job/0", kernel_batch()) for _ in range(2000))
    stats = close_within(pub, 0.5, slack_s=3.0)
    assert stats.accepted == accepted > 0 and stats.queued == 0
    assert stats.delivered + stats.failed + stats.encode_errors == stats.accepted, stats
