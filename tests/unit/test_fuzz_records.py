"""Fuzz targets (hypothesis, fixed small budget) for the codec and every record's ``check()``.

Whatever bytes arrive and whatever values a producer puts in a record, the outcome is a valid record or a
:class:`SchemaError`, never another exception; and a record that passes ``check()`` always encodes and
decodes back to itself (so a checked record cannot fail later in a stage that re-encodes it).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from argus.core.errors import SchemaError
from argus.schemas.codec import MAGIC, codec
from argus.schemas.job_context import JobContext
from argus.schemas.records import (
    CpuStack,
    DeadLetter,
    Finding,
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    PhaseBatch,
    Record,
    Step,
)
from tests.samples import samples

RECORDS: dict[str, type[Record]] = {
    "kernel_batch": KernelBatch, "step": Step, "phase_batch": PhaseBatch, "kernel_summary": KernelSummary,
    "job_topology": JobTopology, "job_lifecycle": JobLifecycle, "finding": Finding, "dead_letter": DeadLetter,
    "cpu_stack": CpuStack, "heartbeat": Heartbeat, "job_context": JobContext,
}
BUDGET = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                  derandomize=True)

EDGES = [0, 1, -1, 2, 3, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**62 - 1, 2**62, -(2**62),
         2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64]
INTS = st.one_of(st.integers(-2, 8), st.sampled_from(EDGES), st.integers(-(2**65), 2**65))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)


def _strategy(tp: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is int:
        return INTS
    if tp is float:
        return st.floats(allow_nan=True)
    if tp is str:
        return TEXT
    if tp is bytes:
        return st.binary(max_size=16)
    if tp is bool:
        return st.booleans()
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if origin is tuple:
        return st.lists(_strategy(args[0]), max_size=4).map(tuple)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else _strategy(a) for a in args))
    raise AssertionError(f"no strategy for {tp!r}")


def _record_strategy(cls: type[Record]) -> st.SearchStrategy[Record]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _strategy(hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


def _column(dtype: str) -> st.SearchStrategy[Any]:
    info = np.iinfo(np.dtype(dtype))
    edges = [v for v in EDGES if info.min <= v <= info.max]
    values = st.one_of(st.integers(max(-2, int(info.min)), 8), st.sampled_from(edges),
                       st.integers(int(info.min), int(info.max)))
    return st.lists(values, max_size=6).map(lambda v: np.array(v, dtype=dtype))


KERNEL_BATCHES = st.builds(
    KernelBatch, job_id=TEXT, rank=INTS, seq=INTS, names=st.lists(TEXT, max_size=3).map(tuple),
    name_idx=_column("<u4"), stream=_column("<u4"), start_ns=_column("<i8"), duration_ns=_column("<i8"),
    step=_column("<i4"), host=TEXT, dropped=INTS, end_of_stream=st.booleans(),
)


def _checked_or_schema_error(rec: Record) -> bool:
    try:
        rec.check()
    except SchemaError:
        return False
    return True


def _same(a: Record, b: Record) -> bool:
    if isinstance(a, KernelBatch):
        return a.to_avro() == b.to_avro()
    if isinstance(a, Finding):  # NaN scores are not equal to themselves
        return a.encode() == b.encode()
    return a == b


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_random_field_values_give_a_valid_record_or_schema_error(name: str) -> None:
    cls = RECORDS[name]
    strategy = KERNEL_BATCHES if cls is KernelBatch else _record_strategy(cls)

    @BUDGET
    @given(strategy)
    def run(rec: Record) -> None:
        if _checked_or_schema_error(rec):
            assert _same(type(rec).decode(rec.encode()), rec)

    run()


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_one_field_of_a_valid_record_replaced_gives_a_valid_record_or_schema_error(name: str) -> None:
    cls = RECORDS[name]
    good = samples()[name]
    hints = typing.get_type_hints(cls)
    columns = ({c: _column(dtype) for c, dtype in (KernelBatch.COLUMNS | KernelBatch.GRAPH_COLUMNS).items()}
               if cls is KernelBatch else {})
    fields = {f.name: columns[f.name] if f.name in columns else _strategy(hints[f.name])
              for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @BUDGET
    @given(st.sampled_from(sorted(fields)).flatmap(lambda f: st.tuples(st.just(f), fields[f])))
    def run(change: tuple[str, Any]) -> None:
        rec = dataclasses.replace(good, **{change[0]: change[1]})  # type: ignore[type-var]
        if _checked_or_schema_error(rec):
            assert _same(type(rec).decode(rec.encode()), rec)

    run()


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_random_bytes_decode_to_a_valid_record_or_schema_error(name: str) -> None:
    cls = RECORDS[name]
    versions = sorted(codec(name).versions)

    @BUDGET
    @given(st.sampled_from(versions), st.binary(max_size=64), st.booleans())
    def run(version: int, body: bytes, framed: bool) -> None:
        payload = bytes((MAGIC, version)) + body if framed else body
        try:
            rec = cls.decode(payload)
        except SchemaError:
            return
        rec.check()

    run()


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_mutated_valid_messages_decode_to_a_valid_record_or_schema_error(name: str) -> None:
    cls = RECORDS[name]
    good = samples()[name].encode()

    @BUDGET
    @given(st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), min_size=1, max_size=4),
           st.integers(0, len(good)))
    def run(flips: list[tuple[int, int]], cut: int) -> None:
        data = bytearray(good)
        for i, b in flips:
            data[i] = b
        try:
            rec = cls.decode(bytes(data[:cut] if cut < 2 else data))
        except SchemaError:
            return
        rec.check()

    run()
