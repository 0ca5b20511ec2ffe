"""publish_in_order: a job's END follows the delivery of everything queued before it."""

from __future__ import annotations

import logging

import pytest

from argus.schemas.records import JobLifecycle, LifecycleEvent
from argus.topics import Topic, job_key, publish_in_order
from tests.samples import RecordingPublisher

END = JobLifecycle("job-o", LifecycleEvent.END, 10**18, 2)


class Stuck(RecordingPublisher):
    """A broker that stays away: every flush leaves ``left`` records undelivered."""

    def __init__(self, left: int, accept: bool = True) -> None:
        super().__init__(accept=accept)
        self.left = left
        self.timeouts: list[float] = []

    def flush(self, timeout_s: float = 30.0) -> int:
        super().flush(timeout_s)
        self.timeouts.append(timeout_s)
        return self.left


def test_flushes_before_publishing() -> None:
    pub = RecordingPublisher()
    pub.publish(Topic.LIFECYCLE, job_key("job-o"), JobLifecycle("job-o", LifecycleEvent.START, 1, 2))
    assert publish_in_order(pub, Topic.LIFECYCLE, job_key("job-o"), END) is True
    assert pub.flushed_at == [1] and pub.records[-1][2] is END


def test_undelivered_records_are_logged_and_the_record_still_published(caplog: pytest.LogCaptureFixture) -> None:
    pub = Stuck(left=3)
    with caplog.at_level(logging.WARNING, logger="argus.topics"):
        assert publish_in_order(pub, Topic.LIFECYCLE, job_key("job-o"), END, timeout_s=0.5) is True
    assert pub.timeouts == [0.5] and pub.records[-1][2] is END
    assert "3 records still undelivered after 0.5 s" in caplog.text and "JobLifecycle" in caplog.text


def test_answers_what_publish_answers() -> None:
    pub = Stuck(left=0, accept=False)
    assert publish_in_order(pub, Topic.LIFECYCLE, job_key("job-o"), END) is False
