"""The demo's compression figure: the worker's summary-bytes counter read through a busy event loop, and the
line that reports it (never ``0 B of summaries = Nonex``)."""

from __future__ import annotations

from typing import Any

from argus.demo import compression_text, worker_counter


def _answers(*replies: dict[str, Any] | None) -> tuple[list[int], Any]:
    """A ``/stats`` reader giving ``replies`` in turn (None: the request timed out), and its call count."""
    calls = [0]

    def read() -> dict[str, Any] | None:
        calls[0] += 1
        return replies[min(calls[0], len(replies)) - 1]

    return calls, read


def test_a_timed_out_request_is_asked_again_not_read_as_zero() -> None:
    # What the demo met: the worker diagnosing the job just processed does not answer within a second.
    calls, read = _answers(None, None, {"summary_bytes_out": 488_556, "summaries_out": 1_920})
    assert worker_counter(read, "summary_bytes_out", timeout_s=60, poll_s=0) == 488_556
    assert calls[0] == 3


def test_a_worker_that_never_answers_gives_none() -> None:
    calls, read = _answers(None)
    assert worker_counter(read, "summary_bytes_out", timeout_s=0, poll_s=0) is None
    assert calls[0] == 1
    _, read = _answers({"summaries_out": 3})
    assert worker_counter(read, "summary_bytes_out", timeout_s=60, poll_s=0) is None  # no such counter


def test_compression_line() -> None:
    assert compression_text(6_517_440, 488_556) == \
        "6,517,440 B of kernel batches -> 488,556 B of summaries = 13.3x"
    assert "unknown" in compression_text(6_517_440, None)
    assert compression_text(6_517_440, 0) == "6,517,440 B of kernel batches -> no summaries sent"
    for line in (compression_text(1, None), compression_text(1, 0)):
        assert "None" not in line and "0 B of summaries" not in line
