"""The job agent's bulk intake (streams/job_intake.py) gives, message by message and in order, what the
record-wise decode gives: the same records, and the same SchemaError for every message that does not decode,
whatever the topics are interleaved with and however many messages a list holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import SchemaError
from argus.schemas.records import JobLifecycle, LifecycleEvent, Step
from argus.streams.job_intake import JobIntake
from argus.topics import RECORD_OF, Topic

from .test_record_columns import phase_messages, step_messages

lifecycle_messages = st.lists(st.builds(
    lambda job, world, cut: JobLifecycle(job, LifecycleEvent.END, 1, world).encode()[:cut],
    st.sampled_from(["job-a", "job-b"]), st.integers(1, 64), st.sampled_from([None, 3])), max_size=3)


def _record_wise(topic: Topic, payload: bytes) -> object:
    try:
        return RECORD_OF[topic].decode(payload)
    except SchemaError as exc:
        return type(exc)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(phase_messages, step_messages, phase_messages, lifecycle_messages, st.randoms(use_true_random=False))
def test_bulk_intake_equals_the_record_wise_decode(phases: list[bytes], steps: list[bytes], more: list[bytes],
                                                   lifecycle: list[bytes], rnd: object) -> None:
    # Enough phases and steps to take the columnar path (and sometimes too few), shuffled together.
    msgs = [(Topic.PHASES, p) for p in phases + more] + [(Topic.STEPS, s) for s in steps * 3] + \
        [(Topic.LIFECYCLE, m) for m in lifecycle]
    rnd.shuffle(msgs)  # type: ignore[attr-defined]
    intake = JobIntake()
    for _ in range(2):  # the join buffers are reused from list to list
        got = intake.decode(msgs)
        assert [type(r) if isinstance(r, SchemaError) else r for r in got] == \
            [_record_wise(t, p) for t, p in msgs]


def test_a_list_of_many_steps_takes_the_columnar_path_and_keeps_order() -> None:
    steps = [Step("job", r % 7, r // 7, 10 * r, 5, None if r % 3 else 4) for r in range(40)]
    msgs = [(Topic.STEPS, s.encode()) for s in steps]
    msgs.insert(5, (Topic.STEPS, b"\x00\x07junk"))
    got = JobIntake().decode(msgs)
    assert isinstance(got[5], SchemaError)
    assert got[:5] + got[6:] == steps
