"""The compiled PhaseBatch reader (schemas/phase_reading.py) decodes what fastavro decodes, to equal records, and
keeps the times packed; whatever it does not read (corrupt or truncated bodies) decodes or fails as with fastavro."""

from __future__ import annotations

import io

import fastavro
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import SchemaError
from argus.schemas import records
from argus.schemas.codec import codec
from argus.schemas.phase_reading import read_phase_batch
from argus.schemas.records import TIME_LIMIT_NS, ParallelGroup, PhaseBatch, PhaseKind


def _slow(payload: bytes) -> PhaseBatch:
    rec = PhaseBatch.from_avro(codec("phase_batch").decode(payload))
    rec.check()
    return rec


def _fails_alike(payload: bytes) -> None:
    """``payload`` raises the same SchemaError through the compiled reader's path as through fastavro's."""
    with pytest.raises(SchemaError) as slow:
        _slow(payload)
    with pytest.raises(SchemaError) as fast:
        PhaseBatch.decode(payload)
    assert str(fast.value) == str(slow.value)


batches = st.integers(0, 8).flatmap(lambda n: st.builds(
    PhaseBatch, st.text(max_size=6), st.integers(0, 2**31 - 1), st.integers(-(2**63), 2**63 - 1),
    st.lists(st.sampled_from(list(PhaseKind)), min_size=n, max_size=n).map(tuple),
    st.lists(st.text(max_size=5), min_size=n, max_size=n).map(tuple),
    st.lists(st.sampled_from(list(ParallelGroup)), min_size=n, max_size=n).map(tuple),
    st.lists(st.integers(-1, 2**63 - 1), min_size=n, max_size=n).map(tuple),
    st.lists(st.integers(-TIME_LIMIT_NS + 1, TIME_LIMIT_NS - 1), min_size=n, max_size=n).map(tuple),
    st.lists(st.integers(0, TIME_LIMIT_NS - 1), min_size=n, max_size=n).map(tuple)))


@settings(max_examples=150, deadline=None)
@given(batches)
def test_compiled_reader_gives_fastavros_record_and_packed_times(batch: PhaseBatch) -> None:
    payload = batch.encode()
    got = PhaseBatch.decode(payload)
    assert got == batch == _slow(payload)
    assert got.packed_times is not None and _slow(payload).packed_times is None
    times = got.times()
    assert times is not None and not times.flags.writeable
    assert times[0].tolist() == list(batch.start_ns) and times[1].tolist() == list(batch.duration_ns)
    assert all(type(a) is type(b) for a, b in zip(got.start_ns + got.duration_ns + got.streams,
                                                  batch.start_ns + batch.duration_ns + batch.streams, strict=True))


@settings(max_examples=60, deadline=None)
@given(batches, st.data())
def test_truncated_or_extended_bodies_fail_as_with_fastavro(batch: PhaseBatch, data: st.DataObject) -> None:
    payload = batch.encode()
    cut = data.draw(st.integers(2, len(payload) - 1))
    for bad in (payload[:cut], payload + b"\x00"):
        _fails_alike(bad)


def test_blocks_with_byte_sizes_are_read() -> None:
    """A writer may split an array into blocks, a negative count followed by the block's size in bytes."""
    def long(v: int) -> bytes:
        out, z = b"", (v << 1) ^ (v >> 63)
        while True:
            out += bytes([(z & 0x7F) | (0x80 if z > 0x7F else 0)])
            z >>= 7
            if not out[-1] & 0x80:
                return out

    def array(items: list[bytes]) -> bytes:  # two blocks: [-1, size, item] then the rest, then 0
        first, rest = items[:1], items[1:]
        body = b""
        if first:
            body += long(-1) + long(len(first[0])) + first[0]
        if rest:
            body += long(len(rest)) + b"".join(rest)
        return body + long(0)

    def string(s: str) -> bytes:
        return long(len(s.encode())) + s.encode()

    body = (string("job") + long(3) + long(-7) + array([long(0), long(3)]) + array([string("f"), string("ar")])
            + array([long(0), long(2)]) + array([long(-1), long(17)]) + array([long(-5), long(10)])
            + array([long(4), long(9)]))
    got = PhaseBatch.decode(bytes((0xA7, 1)) + body)
    assert got == PhaseBatch("job", 3, -7, (PhaseKind.FORWARD, PhaseKind.ALL_REDUCE), ("f", "ar"),
                             (ParallelGroup.NONE, ParallelGroup.TP), (-1, 17), (-5, 10), (4, 9))
    assert got.packed_times is not None


def test_out_of_range_values_are_named_as_by_fastavro() -> None:
    ok = PhaseBatch("j", 1, 2, (PhaseKind.FORWARD,) * 2, ("a", "b"), (ParallelGroup.NONE,) * 2, (7, 7), (1, 2), (3, 4))
    for bad in (dict(duration_ns=(4, -9)), dict(start_ns=(TIME_LIMIT_NS, -TIME_LIMIT_NS)), dict(streams=(7, -2))):
        _fails_alike(PhaseBatch(**{**ok.__dict__, **bad}).encode())


def test_the_reader_leaves_unknown_enum_indices_to_fastavro() -> None:
    payload = PhaseBatch("j", 1, 2, (PhaseKind.OTHER,), ("a",), (ParallelGroup.EP,), (7,), (1,), (3,)).encode()
    at = payload.index(b"\x02\x14")  # kinds: one block of 1, index 10 (OTHER)
    bad = payload[:at] + b"\x02\x16" + payload[at + 2:]  # index 11: no such symbol
    assert read_phase_batch(bad, 2, len(records._KIND_SYMBOLS), len(records._GROUP_SYMBOLS)) is None
    with pytest.raises(SchemaError):
        PhaseBatch.decode(bad)


def test_symbols_are_the_schemas() -> None:
    schema = codec("phase_batch").versions[1]
    types = {f["name"]: f["type"]["items"] for f in schema["fields"] if f["name"] in ("kinds", "groups")}
    assert tuple(types["kinds"]["symbols"]) == records._KIND_SYMBOLS == tuple(k.value for k in PhaseKind)
    assert tuple(types["groups"]["symbols"]) == records._GROUP_SYMBOLS == tuple(g.value for g in ParallelGroup)
    assert codec("phase_batch").latest == records._PHASE_V1


def test_fastavro_encoding_of_a_decoded_batch_is_unchanged() -> None:
    b = PhaseBatch("j", 1, 2, (PhaseKind.FORWARD,), ("a",), (ParallelGroup.NONE,), (7,), (1,), (3,))
    got = PhaseBatch.decode(b.encode())
    assert got.encode() == b.encode()
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, codec("phase_batch").versions[1], got.to_avro())
    assert "packed_times" not in got.to_avro() and np.frombuffer(got.packed_times or b"", "<i8").tolist() == [1, 3]
