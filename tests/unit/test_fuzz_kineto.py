"""Fuzzing the Kineto parser (fixed, small budget): random and mutated traces either parse or raise
ProducerError; never another exception, a crash or unbounded recursion. The guard's verdict on random JSON
values, read in chunks of any size, is the one computed from the values themselves."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from argus.core.errors import ProducerError
from argus.producers import kineto_parse
from argus.producers.kineto_parse import MAX_DEPTH, MAX_NUMBER_DIGITS, parse_rank

T0 = 1_700_000_000_000_000
BASE = {
    "schemaVersion": 1,
    "distributedInfo": {"rank": 1, "world_size": 4, "pg_config": [{"pg_desc": "default_pg", "ranks": [0, 1, 2, 3]}]},
    "deviceProperties": [{"id": 0, "name": "GPU"}],
    "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": T0, "dur": 900, "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "## forward ##", "ts": T0 + 10, "dur": 300, "args": {}},
        {"ph": "X", "cat": "kernel", "name": 'gemm<float, "x">', "ts": T0 + 20.125, "dur": 100.5,
         "args": {"stream": 7, "grid": [1, 2, 3], "blocks per SM": 1.5e-05}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": T0 + 200, "dur": 3, "tid": 9, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": T0 + 5, "dur": 1, "args": {"Input Dims": [[2, 3]]}},
    ],
    "baseTimeNanoseconds": 1_000,
}
SNIPPETS = [b"[" * 70, b"{" * 3, b"]", b"}", b'"', b"\\", b'\\"', b",", b":", b"-", b"9" * 120, b"9" * 5000,
            b"1e99999", b"1E-1000000000", b".5", b"0.000", b"null", b"true", b"\xff\xfe", b"\x00", b'"name": "k"',
            b'"ts": 1e308', b"ProfilerStep#" + b"9" * 30, b'{"rank": 300000000}', b" " * 10, b'"\\u0000"']
CHUNKS = st.sampled_from([1, 2, 3, 7, 64, 4096, 256 * 1024])


def parse(data: bytes, chunk: int, name: str = "rank1.json") -> kineto_parse.RankTrace | ProducerError:
    """Parse ``data`` as a file read ``chunk`` bytes at a time: the trace (closed) or the ProducerError.
    Anything else propagates and fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        try:
            with mock.patch.object(kineto_parse, "_CHUNK", chunk), parse_rank(path, spill_dir=Path(tmp)) as trace:
                return trace
        except ProducerError as exc:
            assert name in str(exc)
            return exc


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(json.dumps(BASE, indent=draw(st.sampled_from([None, 1]))).encode())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "byte", "copy"]))
        if op == "insert":
            data[at:at] = draw(st.sampled_from(SNIPPETS))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 40))]
        elif op == "byte" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "copy":
            start = draw(st.integers(0, len(data)))
            data[at:at] = data[start:start + draw(st.integers(1, 200))]
    return bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated(), chunk=CHUNKS, packed=st.booleans(), cut=st.integers(0, 8))
def test_mutated_traces_parse_or_raise_producer_error(data: bytes, chunk: int, packed: bool, cut: int) -> None:
    if packed:
        data = gzip.compress(data)
        data = data[:len(data) - cut] if cut else data  # truncated gzip too
    got = parse(data, chunk, "rank1.json.gz" if packed else "rank1.json")
    event(f"{type(got).__name__}: {str(got).partition(': ')[2][:30]}" if isinstance(got, ProducerError)
          else "parsed")


SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(10**95, 10**105)
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(st.sampled_from(list('ab"\\[]{}0123456789eE+-.: \u00e9\u2028')), max_size=30))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=12)


def depth(v: Any) -> int:
    if isinstance(v, list):
        return 1 + max(map(depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(depth, v.values()), default=0)
    return 0


def digits(v: Any) -> int:
    """The most digits of an integer in ``v`` (floats are written with 17 at most)."""
    if isinstance(v, list):
        return max(map(digits, v), default=0)
    if isinstance(v, dict):
        return max(map(digits, v.values()), default=0)
    return len(str(abs(v))) if type(v) is int else 0


@st.composite
def deep_values(draw: st.DrawFn) -> Any:
    value = draw(VALUES)
    for _ in range(draw(st.integers(0, 8) | st.integers(MAX_DEPTH - 8, MAX_DEPTH + 2))):  # around the limit
        value = [value] if draw(st.booleans()) else {draw(st.text(max_size=3)): value}
    return value


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=deep_values(), chunk=CHUNKS, where=st.sampled_from(["args", "head", "tail"]))
def test_the_guard_refuses_exactly_what_breaks_a_limit(value: Any, chunk: int, where: str) -> None:
    doc: dict[str, Any] = json.loads(json.dumps(BASE))
    if where == "args":
        doc["traceEvents"][2]["args"]["x"] = value
        level = 4 + depth(value)  # top object, traceEvents, event, args
    else:
        doc = {"head": value, **doc} if where == "head" else {**doc, "tail": value}
        level = 1 + depth(value)
    got = parse(json.dumps(doc).encode(), chunk)
    too_deep, too_long = level > MAX_DEPTH, digits(value) > MAX_NUMBER_DIGITS
    event(f"{where}: " + ("too deep" if too_deep else "too long a number" if too_long else "fine"))
    if not (too_deep or too_long):
        assert isinstance(got, kineto_parse.RankTrace), got
        assert got.kernel_events == 2 and got.rank == 1 and [s.step for s in got.steps] == [3]
        return
    assert isinstance(got, ProducerError), (level, digits(value))
    assert "refused: " in str(got)
    assert ("nesting deeper" in str(got)) or ("digits in a row" in str(got)), got
    if where == "args":
        assert "in traceEvents[2] (name 'gemm<float, \\\\\"x\\\\\">')" in str(got), got
    else:
        assert f"in top-level key {where!r}" in str(got), got
