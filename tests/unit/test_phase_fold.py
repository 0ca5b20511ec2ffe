"""The compiled fold of a phase layout's batches (argus.detectors.phase_fold, PhaseLayout.fold_rows) against
plain per-batch evaluations: the same per-id sums and nested blocking times, whichever pairs a layout kept from
its earlier batches, shared or fresh tuples; and the medians over steps of the folded history (row_medians)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.detectors import l2_history, phase_fold, phase_layout
from argus.detectors.l2_history import row_medians
from argus.detectors.phase_layout import LayoutIndex, PhaseLayout, nested_one
from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind

PROPERTY = settings(max_examples=60, deadline=None)
F, B, OPT = PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER
AR, SR, DL = PhaseKind.ALL_REDUCE, PhaseKind.SEND_RECV, PhaseKind.DATA_LOADER
N, TP, PP, DP, EP = ParallelGroup.NONE, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.DP, ParallelGroup.EP
LAYOUT = (("fwd", F, N), ("attn", F, N), ("ar", AR, TP), ("mlp", F, N), ("ar", AR, TP), ("bwd", B, N),
          ("pp", SR, PP), ("dp", AR, DP), ("opt", OPT, N), ("data", DL, N), *(("ep", PhaseKind.ALL_TO_ALL, EP),) * 6)


def _batches(rng: np.random.Generator, n: int, jitter: int, share_starts: bool,
             negative: bool = False) -> list[PhaseBatch]:
    """``n`` batches of one layout: phases one after another from a common offset, each moved by up to
    ``jitter`` ns (large jitter: timelines that differ, many pairs meet, by coverage); the forward holds the
    layers. ``negative``: some durations below 0 (clock skew in a bad record)."""
    names, kinds, groups = (tuple(x[i] for x in LAYOUT) for i in range(3))
    streams = tuple(-1 for _ in LAYOUT)
    shared = None
    out = []
    for r in range(n):
        dur = rng.integers(-300 if negative else 0, 2000, len(LAYOUT))
        start = np.cumsum(dur) - dur + rng.integers(0, jitter + 1, len(LAYOUT))
        start[0], dur[0] = 0, int(start.max() + dur.max())  # the forward spans the layers
        starts = tuple(int(x) + 10**12 for x in start)
        if share_starts:
            shared = shared or starts
            starts = shared
        out.append(PhaseBatch("j", r, 0, kinds, names, groups, streams, starts, tuple(int(x) for x in dur)))
    return out


def _per_batch(lay: PhaseLayout, batches: list[PhaseBatch]) -> tuple[np.ndarray, np.ndarray]:
    """Per batch, the sums per id and the nested time per id, one batch at a time (float, exact here)."""
    sums, nested = [], []
    for b in batches:
        dur = np.asarray(b.duration_ns, dtype=np.float64)
        sums.append(np.bincount(lay.inverse, weights=dur, minlength=lay.ids.size))
        nested.append(np.bincount(lay.inverse, weights=nested_one(b.start_ns, dur, lay), minlength=lay.ids.size))
    return np.rint(sums).astype(np.int64), np.rint(nested).astype(np.int64)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       jitters=st.lists(st.sampled_from([0, 50, 3000, 10**6]), min_size=4, max_size=4), share=st.booleans(),
       decoded=st.booleans(), negative=st.booleans())
def test_fold_rows_matches_the_per_batch_evaluation(seed: int, sizes: list[int], jitters: list[int],
                                                    share: bool, decoded: bool, negative: bool) -> None:
    """One layout folded call after call (the pairs it keeps from one call serve the next) gives each call's
    per-batch sums and nested times, from the batches' columns or (``decoded``) their packed times, and so does
    the coverage evaluation."""
    rng = np.random.default_rng(seed)
    index = LayoutIndex()
    for i, n in enumerate(sizes):
        # Negative durations only built in-process: records refuse them on the wire.
        batches = _batches(rng, n, jitters[i], share, negative and not decoded)
        if decoded:
            batches = [PhaseBatch.decode(b.encode()) for b in batches]
            assert all(b.packed_times is not None for b in batches)
        which, folded = index.fold(batches)
        assert which.tolist() == [0] * n and len(folded) == 1
        lay = index.layouts[0]
        want_sums, want_nested = _per_batch(lay, batches)
        assert np.array_equal(folded[0].duration, want_sums)
        assert np.array_equal(folded[0].nested, want_nested)
        start, dur = lay.columns(batches, "start_ns"), lay.columns(batches, "duration_ns")
        span = int((start - start.min(axis=1, keepdims=True) + dur).max()) + 1
        assert np.array_equal(lay._nested_by_coverage(start, dur, span), want_nested)
        if decoded:
            packed = lay.unpack([b.packed_times for b in batches])
            assert np.array_equal(packed, np.concatenate([start, dur], axis=1))
            assert all(np.array_equal(a, b) for a, b in zip(lay.fold_packed(packed), lay.fold_rows(start, dur),
                                                             strict=True))


def test_fold_rows_refuses_columns_beyond_its_arrays() -> None:
    """The compiled pass reads no column outside the arrays it is given."""
    lay = LayoutIndex()
    batches = _batches(np.random.default_rng(3), 2, 0, False)
    lay.fold(batches)
    layout = lay.layouts[0]
    start = layout.columns(batches, "start_ns")
    no_pairs = np.zeros(layout.outer.size + 1, dtype=np.int64), np.empty(0, np.int64)
    args = (layout.inverse, layout.ids.size, layout.outer, layout.block, *no_pairs)
    with pytest.raises(ValueError, match="do not fit"):
        phase_fold.fold_rows(start, start, *args, dur_at=1)
    with pytest.raises(ValueError, match="do not fit"):
        phase_fold.fold_rows(start[:1], start, *args)


def test_fold_groups_batches_by_layout_whatever_their_tuples() -> None:
    """Batches of two layouts, interleaved, with shared or fresh (equal) tuples: one layout each, in the order
    first seen, and each batch's rows where it is."""
    rng = np.random.default_rng(7)
    a = _batches(rng, 6, 0, True)
    b = [PhaseBatch("j", x.rank + 10, 0, x.kinds[:-1], x.names[:-1], x.groups[:-1], x.streams[:-1],
                    x.start_ns[:-1], x.duration_ns[:-1]) for x in _batches(rng, 6, 0, False)]
    fresh = [PhaseBatch(x.job_id, x.rank, x.step, tuple(x.kinds), tuple(list(x.names)), tuple(list(x.groups)),
                        x.streams, tuple(list(x.start_ns)), x.duration_ns) for x in a[::2]]
    mixed = [b[0], *a[:3], b[1], *fresh, *b[2:], *a[3:]]
    which, folded = LayoutIndex().fold(mixed)
    assert which.tolist() == [0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert [f.layout for f in folded] == [0, 1]
    index = LayoutIndex()
    for f in folded:
        got = [mixed[i] for i in f.members.tolist()]
        one = index.fold(got)[1][0]
        assert np.array_equal(one.duration, f.duration) and np.array_equal(one.nested, f.nested)


@pytest.mark.parametrize("built", [False, True])
def test_fold_groups_decoded_batches_by_their_shared_layout(built: bool) -> None:
    """Decoded batches (one shared layout tuple per layout decoded), one whose streams differ (another shared
    tuple, the same layout), and, with ``built``, batches built in-process among them: the layouts and sums of
    the same batches built in-process."""
    rng = np.random.default_rng(11)
    a = _batches(rng, 5, 50, False)
    b = [PhaseBatch("j", x.rank + 10, 0, x.kinds[:-2], x.names[:-2], x.groups[:-2], x.streams[:-2],
                    x.start_ns[:-2], x.duration_ns[:-2]) for x in _batches(rng, 4, 50, False)]
    other_streams = dataclasses.replace(a[4], rank=20, streams=tuple(range(len(LAYOUT))))
    plain = [a[0], b[0], *a[1:3], other_streams, *b[1:], *a[3:]]
    decoded = [PhaseBatch.decode(x.encode()) for x in plain]
    assert decoded[0].shared_layout is decoded[2].shared_layout is not None
    assert decoded[4].shared_layout is not decoded[2].shared_layout
    got_in = [plain[i] if built and i % 3 == 0 else x for i, x in enumerate(decoded)]
    which, folded = LayoutIndex().fold(got_in)
    want_which, want = LayoutIndex().fold(plain)
    assert which.tolist() == want_which.tolist() == [0, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    for f, w in zip(folded, want, strict=True):
        assert f.layout == w.layout and np.array_equal(f.members, w.members)
        assert np.array_equal(f.duration, w.duration) and np.array_equal(f.nested, w.nested)


def test_columns_convert_what_struct_refuses_as_before() -> None:
    """A float or a numeric string in a column is read as np.fromiter reads it (truncated, parsed); a value
    beyond int64 raises DetectorError; shared rows come back per batch."""
    assert phase_layout._int64s([(1, 2), (3, 4)], 2, "x").tolist() == [1, 2, 3, 4]
    assert phase_layout._int64s([(1.7, "5"), (3, True)], 2, "x").tolist() == [1, 5, 3, 1]
    try:
        phase_layout._int64s([(2**63, 0)], 2, "x")
    except DetectorError as exc:
        assert "x" in str(exc)
    else:
        raise AssertionError("a value beyond int64 was taken")
    batches = _batches(np.random.default_rng(1), 4, 0, True)
    index = LayoutIndex()
    index.fold(batches)
    cols = index.layouts[0].columns(batches, "start_ns")
    assert cols.shape == (4, len(LAYOUT)) and (cols == np.asarray(batches[0].start_ns)).all()


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 700), width=st.integers(1, 40),
       pick=st.booleans(), wide=st.booleans())
def test_row_medians_are_numpys(seed: int, rows: int, width: int, pick: bool, wide: bool) -> None:
    rng = np.random.default_rng(seed)
    mat = rng.integers(0, 50 if not wide else 2**31 - 1, (rows, width)).astype(np.int64 if wide else np.int32)
    cols = sorted(rng.choice(width, size=int(rng.integers(1, width + 1)), replace=False).tolist()) if pick else None
    want = np.median(mat if cols is None else mat[:, cols], axis=1) if rows else np.empty(0)
    assert np.array_equal(row_medians(mat, cols), want)
    saved = l2_history._SORT_BLOCK_VALUES
    try:  # blocks of a row or two: the rows of every block, and the last, partial one
        l2_history._SORT_BLOCK_VALUES = 7
        assert np.array_equal(row_medians(mat, cols), want)
    finally:
        l2_history._SORT_BLOCK_VALUES = saved
