"""The publisher never blocks or raises into the caller: a full queue drops and counts."""

from __future__ import annotations

from argus.core.settings import Settings
from argus.producers.publisher import Publisher
from argus.topics import Topic
from tests.samples import kernel_batch


def test_full_queue_drops_and_counts_without_blocking() -> None:
    # No broker and no sender thread: nothing drains the queue, so it fills up.
    settings = Settings.load(env={}, bootstrap_servers="127.0.0.1:1", publisher_queue_max=3)
    pub = Publisher(settings, sender=False)
    results = [pub.publish(Topic.KERNELS, b"j/0", kernel_batch()) for _ in range(5)]
    assert results == [True, True, True, False, False]
    stats = pub.stats()
    assert (stats.accepted, stats.dropped, stats.queued) == (3, 2, 3)


def test_publish_after_close_is_dropped_not_raised() -> None:
    settings = Settings.load(env={}, bootstrap_servers="127.0.0.1:1", publisher_queue_max=3)
    pub = Publisher(settings, extra_config={"message.timeout.ms": 100})
    pub.close(timeout_s=0.5)
    assert pub.publish(Topic.STEPS, b"j/0", kernel_batch()) is False
    assert pub.stats().dropped == 1


def test_unencodable_record_is_counted_and_sender_survives() -> None:
    settings = Settings.load(env={}, bootstrap_servers="127.0.0.1:1", publisher_queue_max=10)
    pub = Publisher(settings, extra_config={"message.timeout.ms": 100})

    class Broken:
        def encode(self) -> bytes:
            raise ValueError("boom")

    assert pub.publish(Topic.KERNELS, b"j/0", Broken())
    assert pub.publish(Topic.KERNELS, b"j/0", b"raw bytes are not records")  # type: ignore[arg-type]
    pub.flush(timeout_s=1.0)
    stats = pub.close(timeout_s=0.5)
    assert stats.encode_errors == 2
