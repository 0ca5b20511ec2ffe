"""Packed integer columns (``kernel_batch`` v2): exact round trips over the whole int64 range, the narrowest
width with patches for the few wide codes, and clean errors on bytes that are not a packed column."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from argus.core.errors import SchemaError
from argus.schemas.column_packing import HEADER_BYTES, PackMethod, pack_column, unpack_column

_INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(values=hnp.arrays(np.int64, st.integers(0, 64), elements=_INT64),
       n_groups=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_round_trip_is_exact_for_any_int64_column(values: np.ndarray, n_groups: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, n_groups, values.size).astype(np.int64)
    after = rng.integers(-(2**63), 2**63 - 1, values.size, endpoint=True).astype(np.int64)
    assert np.array_equal(unpack_column(pack_column(values), "x"), values)
    assert np.array_equal(unpack_column(pack_column(values, groups), "x", groups), values)
    assert np.array_equal(unpack_column(pack_column(values, groups, after), "x", groups, after), values)


def _kernels(n: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Streams interleaved in event order; per stream one kernel after the other, 1-3 us apart."""
    rng = np.random.default_rng(seed)
    stream = rng.choice([7, 13, 17], n).astype(np.int64)
    dur = rng.integers(5_000, 900_000, n).astype(np.int64)
    start = np.empty(n, dtype=np.int64)
    for s in (7, 13, 17):
        idx = np.flatnonzero(stream == s)
        gaps = rng.integers(1_000, 3_000, idx.size)
        start[idx] = 1_780_000_000_000_000_000 + np.cumsum(gaps + np.concatenate([[0], dur[idx][:-1]]))
    return start, stream, dur


def test_kernel_starts_are_coded_as_gaps_after_the_previous_kernel_of_their_stream() -> None:
    n = 4096
    start, stream, dur = _kernels(n)
    packed = pack_column(start, stream, dur)
    # Gaps of 1-3 us, zigzag-coded: two bytes each (a stream's first start from the base as well).
    assert packed[0] == PackMethod.GAP and packed[1] == 2 and len(packed) == HEADER_BYTES + 2 * n
    assert np.array_equal(unpack_column(packed, "start_ns", stream, dur), start)
    assert pack_column(np.random.default_rng(1).integers(0, 200, n))[1] == 1
    assert pack_column(np.full(n, -1))[1] == 1  # steps all unknown: one byte each


def test_a_few_wide_codes_are_patched_instead_of_widening_the_column() -> None:
    start, stream, dur = _kernels(4096)
    start[2000:] += 30 * 10**9  # a 30 s pause (a checkpoint) in the middle: one wide gap per stream
    packed = pack_column(start, stream, dur)
    patches = int.from_bytes(packed[10:14], "little")
    assert packed[1] == 2 and patches == 3 and len(packed) == HEADER_BYTES + 2 * 4096 + 12 * patches
    assert np.array_equal(unpack_column(packed, "start_ns", stream, dur), start)


@pytest.mark.parametrize(("data", "reason"), [
    (b"\x00\x01", "shorter than"),
    (bytes((5, 1)) + bytes(12), "unknown packing"),
    (bytes((0, 3)) + bytes(12), "unknown packing"),
    (bytes((0, 4)) + bytes(12) + b"\x01\x02\x03", "whole codes"),
    (bytes((0, 1)) + bytes(8) + (1).to_bytes(4, "little") + b"\x01", "whole codes"),
    (bytes((0, 1)) + bytes(8) + (1).to_bytes(4, "little") + b"\x01" + (5).to_bytes(4, "little") + bytes(8),
     "patch of event 5 beyond its 1 events"),
    (bytes((1, 1)) + bytes(12) + b"\x01\x02", "needs 2 groups"),
])
def test_bytes_that_are_not_a_packed_column_raise_schema_error(data: bytes, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        unpack_column(data, "x")


def test_columns_of_another_length_cannot_be_packed() -> None:
    with pytest.raises(SchemaError, match="3 values to pack with 2 groups"):
        pack_column([1, 2, 3], [0, 1])
    with pytest.raises(SchemaError, match="3 values to pack with 1 after"):
        pack_column([1, 2, 3], [0, 1, 1], [5])


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=80))
def test_arbitrary_bytes_decode_or_raise_schema_error(data: bytes) -> None:
    try:
        out = unpack_column(data, "x", None)
    except SchemaError:
        return
    assert out.dtype == np.int64
