"""Columnar decoding (schemas/record_columns.py) gives, message by message, what the record-wise decode gives:
the same records (layouts shared, times packed), and every message it does not read (corrupt, out of range,
another version) left to the record-wise decode, which decodes it or raises."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import SchemaError
from argus.schemas import phase_reading
from argus.schemas.codec import codec
from argus.schemas.record_columns import JoinBuffer, decode_phase_batches, decode_steps
from argus.schemas.records import TIME_LIMIT_NS, ParallelGroup, PhaseBatch, PhaseKind, Step

JOBS = st.sampled_from(["job-a", "job-b", "é", ""])
times = st.integers(-TIME_LIMIT_NS + 1, TIME_LIMIT_NS - 1)
durations = st.integers(0, TIME_LIMIT_NS - 1)
#: A few layouts (ranks of one job repeat them), so messages share and differ.
layouts = st.integers(0, 6).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from(list(PhaseKind)), min_size=n, max_size=n).map(tuple),
    st.lists(st.text(max_size=4), min_size=n, max_size=n).map(tuple),
    st.lists(st.sampled_from(list(ParallelGroup)), min_size=n, max_size=n).map(tuple),
    st.lists(st.integers(-1, 2**63 - 1), min_size=n, max_size=n).map(tuple)))


@st.composite
def phase_batch(draw: st.DrawFn, layout: tuple[tuple, ...]) -> PhaseBatch:
    n = len(layout[0])
    return PhaseBatch(draw(JOBS), draw(st.integers(0, 2**31 - 1)), draw(st.integers(-(2**63), 2**63 - 1)), *layout,
                      tuple(draw(st.lists(times, min_size=n, max_size=n))),
                      tuple(draw(st.lists(durations, min_size=n, max_size=n))))


@st.composite
def messages(draw: st.DrawFn, make: st.SearchStrategy[bytes]) -> list[bytes]:
    """Valid messages, some damaged: truncated, extended, a byte changed, or another version byte."""
    out = draw(st.lists(make, max_size=12))
    for i in draw(st.lists(st.integers(0, max(len(out) - 1, 0)), max_size=3)) if out else []:
        p = out[i]
        if not p:  # cut to nothing already
            continue
        how = draw(st.sampled_from(["cut", "extend", "flip", "version"]))
        if how == "cut":
            out[i] = p[:draw(st.integers(0, len(p) - 1))]
        elif how == "extend":
            out[i] = p + b"\x00"
        elif how == "flip":
            at = draw(st.integers(0, len(p) - 1))
            out[i] = p[:at] + bytes([draw(st.integers(0, 255))]) + p[at + 1:]
        else:
            out[i] = p[:1] + b"\x02" + p[2:]
    return out


phase_messages = messages(st.lists(layouts, min_size=1, max_size=3).flatmap(
    lambda lays: st.sampled_from(lays).flatmap(phase_batch)).map(lambda b: b.encode()))
step_messages = messages(st.builds(Step, JOBS, st.integers(0, 2**31 - 1), st.integers(-(2**63), 2**63 - 1), times,
                                   durations, st.none() | durations, st.none() | st.integers(0, 2**63 - 1))
                         .flatmap(lambda s: st.sampled_from([s.encode(), *([] if s.expert_tokens is not None
                                                                           else [_step_v1(s)])])))


def _step_v1(step: Step) -> bytes:
    """``step`` as a writer of ``step.v1`` sends it (no ``expert_tokens``)."""
    return codec(Step.SCHEMA).encode({k: v for k, v in step.to_avro().items() if k != "expert_tokens"}, version=1)


def _record_wise(decode: object, payload: bytes) -> object:
    try:
        return decode(payload)  # type: ignore[operator]
    except SchemaError as exc:
        return exc


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(phase_messages)
def test_columnar_phase_batches_equal_the_record_wise_decode(payloads: list[bytes]) -> None:
    cols = decode_phase_batches(payloads, JoinBuffer())
    assert sorted([*cols.index.tolist(), *cols.rest]) == list(range(len(payloads)))
    for k, i in enumerate(cols.index.tolist()):
        want = PhaseBatch.decode(payloads[i])  # read here: the record-wise decode takes it too
        got = cols.batch(k)
        assert got == want and got.packed_times == want.packed_times and got.shared_layout is want.shared_layout
        assert cols.starts(k).tolist() == list(want.start_ns) and cols.durations(k).tolist() == list(want.duration_ns)
        assert not cols.times.flags.writeable
    for i in cols.rest:
        got_rest = _record_wise(PhaseBatch.decode, payloads[i])
        # Left to the record-wise decode: what it rejects, or what the compiled reader does not read.
        assert isinstance(got_rest, SchemaError) or payloads[i][1:2] != b"\x01" or got_rest.packed_times is None


@settings(max_examples=200, deadline=None)
@given(step_messages)
def test_columnar_steps_equal_the_record_wise_decode(payloads: list[bytes]) -> None:
    cols = decode_steps(payloads)
    assert sorted([*cols.index.tolist(), *cols.rest]) == list(range(len(payloads)))
    for k, i in enumerate(cols.index.tolist()):
        got = cols.record(k)
        assert got == Step.decode(payloads[i])
        assert type(got.gpu_ns) is type(Step.decode(payloads[i]).gpu_ns)
        assert type(got.expert_tokens) is type(Step.decode(payloads[i]).expert_tokens)
    for i in cols.rest:
        assert isinstance(_record_wise(Step.decode, payloads[i]), SchemaError) or payloads[i][1:2] not in (b"\x01",
                                                                                                          b"\x02")


def test_valid_messages_are_all_read_by_columns() -> None:
    lay = ((PhaseKind.FORWARD, PhaseKind.ALL_REDUCE), ("f", "ar"), (ParallelGroup.NONE, ParallelGroup.TP), (-1, 3))
    batches = [PhaseBatch("j", r, 5, *lay, (10 * r, 10 * r + 1), (3, 4)) for r in range(50)]
    cols = decode_phase_batches([b.encode() for b in batches])
    assert cols.rest == () and cols.rank.tolist() == list(range(50)) and len(cols.layouts) == 1
    assert cols.width.tolist() == [2] * 50 and cols.jobs == ("j",)
    assert [cols.batch(k) for k in range(50)] == batches
    steps = [Step("j", r, 5, 100, 7, None if r % 2 else 3) for r in range(50)]
    sc = decode_steps([s.encode() for s in steps])
    assert sc.rest == () and [sc.record(k) for k in range(50)] == steps


def test_values_the_checks_reject_are_left_to_the_record_wise_decode() -> None:
    lay = ((PhaseKind.FORWARD,), ("f",), (ParallelGroup.NONE,), (7,))
    good = PhaseBatch("j", 1, 2, *lay, (1,), (3,))
    bad = [PhaseBatch("j", 1, 2, *lay, (1,), (-1,)), PhaseBatch("j", 2**31, 2, *lay, (1,), (3,)),
           PhaseBatch("j", 1, 2, lay[0], lay[1], lay[2], (-2,), (1,), (3,)),
           PhaseBatch("j", 1, 2, *lay, (TIME_LIMIT_NS,), (3,))]
    payloads = [good.encode(), *(PhaseBatch.encode(b) for b in bad)]
    cols = decode_phase_batches(payloads)
    assert cols.index.tolist() == [0] and cols.rest == (1, 2, 3, 4)
    for i in cols.rest:
        with pytest.raises(SchemaError):
            PhaseBatch.decode(payloads[i])


def test_past_the_distinct_layouts_one_call_tells_apart_messages_go_record_wise() -> None:
    n = phase_reading.MAX_LAYOUTS + 3
    batches = [PhaseBatch("j", r, 0, (PhaseKind.FORWARD,), (f"p{r}",), (ParallelGroup.NONE,), (0,), (1,), (2,))
               for r in range(n)]
    cols = decode_phase_batches([b.encode() for b in batches])
    assert len(cols) == phase_reading.MAX_LAYOUTS and cols.rest == tuple(range(phase_reading.MAX_LAYOUTS, n))
    assert [cols.batch(k) for k in range(len(cols))] == batches[:phase_reading.MAX_LAYOUTS]


def test_an_empty_call_and_a_reused_buffer() -> None:
    buf = JoinBuffer()
    assert len(decode_phase_batches([], buf)) == 0 and len(decode_steps([], buf)) == 0
    big = [Step("j" * 100, r, 1, 2, 3).encode() for r in range(20)]
    small = [Step("k", 1, 1, 2, 3).encode()]
    assert len(decode_steps(big, buf)) == 20
    got = decode_steps(small, buf)  # the buffer is longer than these bytes: only theirs are read
    assert got.rest == () and got.record(0) == Step("k", 1, 1, 2, 3)
    assert np.array_equal(got.index, [0])
