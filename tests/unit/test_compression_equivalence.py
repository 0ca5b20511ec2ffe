"""The compiled compression core (issue 10's line rate) against what it replaced.

* :func:`ref_cluster_durations` is the numpy statement of KDE valley clustering that
  :mod:`argus.detectors.kde_valleys` compiles (scipy's ``find_peaks`` and ``peak_prominences``, one group at a
  time, ``np.lexsort`` for the window); the clusters must be equal, column by column, on random multimodal,
  coarse-timer and tiny groups and on every window of a simulated job.
* The summaries the compression router emits for simulated jobs (each seed fault case, and small batches)
  must be the very records the numpy core emitted: their Avro bytes are digested and compared with digests
  taken before the core was compiled. A change that means to alter the summaries updates ``GOLDEN``.
* Packed columns decoded by :mod:`argus.schemas.column_unpacking` must give what the numpy statement of
  :func:`~argus.schemas.column_packing.unpack_column` gives (and the values packed).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.signal import find_peaks, peak_prominences

from argus.core.errors import SchemaError
from argus.core.settings import Settings
from argus.demo import build_spec
from argus.detectors import ClusterSet, KdeParams, cluster_by_group, cluster_durations
from argus.detectors.kde_clusters import _binned_kde, _summarize
from argus.detectors.kde_valleys import dense_codes, radix_sort
from argus.producers.simulator import JobSimulator
from argus.schemas import column_packing
from argus.schemas.records import KernelBatch
from argus.streams.compression_router import CompressionRouter
from argus.streams.windows import WindowBuffer
from argus.topics import Topic

PROPERTY = settings(max_examples=150, deadline=None)

# -- the reference: the numpy statement the compiled kernels replaced ------------------------------------


def ref_cuts_sorted(xs: np.ndarray, p: KdeParams) -> np.ndarray:
    n = xs.size
    if n < 2 * p.min_samples or xs[0] == xs[-1] or p.max_clusters == 1:
        return np.empty(0, dtype=np.int64)
    y = np.log(xs.astype(np.float64))
    h = max(float(np.std(y, ddof=1)) * n ** (-0.2), p.min_bandwidth)
    gaps = np.diff(y) > p.isolated_gap * h
    lo_k = max((i for i in range(1, min(p.min_samples, n)) if gaps[i - 1]), default=0)
    hi_k = max((i for i in range(1, min(p.min_samples, n)) if gaps[n - i - 1]), default=0)
    if lo_k + hi_k > 0 and n - lo_k - hi_k >= 2:
        bulk = y[lo_k:n - hi_k]
        h = max(float(np.std(bulk, ddof=1)) * bulk.size ** (-0.2), p.min_bandwidth)
    ymin, ymax = float(y[0]), float(y[-1])
    span = (ymax - ymin) / h + 2.0 * p.grid_margin
    points = min(p.grid_points, max(16, math.ceil(span * 10.0) + 1))
    grid, dens = _binned_kde(y, ymin, ymax, h, points, p.grid_margin)
    idx, _ = find_peaks(-dens)
    if idx.size == 0:
        return np.empty(0, dtype=np.int64)
    dip = peak_prominences(-dens, idx)[0]
    noise = np.sqrt((2.0 * dens[idx] + dip) * (1.0 / (2.0 * math.sqrt(math.pi))) / (n * h))
    z = dip / np.maximum(noise, np.finfo(np.float64).tiny)
    pos = grid[idx]
    below = np.searchsorted(y, pos, side="left")
    ok = (z >= p.min_valley_z) & (pos - ymin >= p.min_log_gap) & (ymax - pos >= p.min_log_gap)
    ok &= (below >= p.min_samples) & (n - below >= p.min_samples)
    acc_pos: list[float] = []
    acc_below: list[int] = []
    for i in np.flatnonzero(ok)[np.argsort(-z[ok], kind="stable")].tolist():
        v, c = float(pos[i]), int(below[i])
        k = bisect.bisect_left(acc_pos, v)
        left_pos, left_below = (acc_pos[k - 1], acc_below[k - 1]) if k > 0 else (-math.inf, 0)
        right_pos, right_below = (acc_pos[k], acc_below[k]) if k < len(acc_pos) else (math.inf, n)
        if v - left_pos < p.min_log_gap or right_pos - v < p.min_log_gap:
            continue
        if c - left_below < p.min_samples or right_below - c < p.min_samples:
            continue
        acc_pos.insert(k, v)
        acc_below.insert(k, c)
        if len(acc_pos) == p.max_clusters - 1:
            break
    return np.asarray(acc_below, dtype=np.int64)


def ref_refined_cuts(xs: np.ndarray, p: KdeParams) -> np.ndarray:
    """ref_cuts_sorted, then again inside each cluster (last one first), within max_clusters in all."""
    cuts = ref_cuts_sorted(xs, p).tolist()
    bounds = [0, *cuts, xs.size]
    stack = list(itertools.pairwise(bounds)) if cuts else []
    while stack and len(cuts) < p.max_clusters - 1:
        a, b = stack.pop()
        inner = [a + int(c) for c in ref_cuts_sorted(xs[a:b], dataclasses.replace(
            p, max_clusters=p.max_clusters - len(cuts)))]
        cuts += inner
        if inner:
            edges = [a, *inner, b]
            stack += list(itertools.pairwise(edges))
    return np.sort(np.asarray(cuts, dtype=np.int64))


def ref_cluster_durations(x: np.ndarray, p: KdeParams) -> ClusterSet:
    xs = np.sort(np.maximum(np.asarray(x, dtype=np.int64), 1))
    edges = np.concatenate(([0], ref_refined_cuts(xs, p), [xs.size])).astype(np.int64)
    return _summarize(xs, edges)


def ref_cluster_by_group(g: np.ndarray, x: np.ndarray, p: KdeParams) -> list[tuple[int, ClusterSet]]:
    order = np.lexsort((x, g))
    gs, xs = g[order], x[order]
    starts = np.flatnonzero(np.concatenate(([True], gs[1:] != gs[:-1])))
    ends = np.append(starts[1:], xs.size)
    return [(int(gs[s]), ref_cluster_durations(xs[s:e], p)) for s, e in zip(starts, ends, strict=True)]


def assert_same(got: ClusterSet, want: ClusterSet) -> None:
    for col in ("count", "p50_ns", "p99_ns", "min_ns", "max_ns", "sum_ns"):
        assert getattr(got, col).tolist() == getattr(want, col).tolist(), col


# -- random groups ---------------------------------------------------------------------------------------


@st.composite
def groups(draw: st.DrawFn) -> np.ndarray:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    modes = draw(st.integers(1, 4))
    parts = []
    for _ in range(modes):
        n = draw(st.sampled_from([1, 3, 9, 10, 25, 200, 3000]))
        median = draw(st.sampled_from([1.0, 50.0, 2_000.0, 80_000.0, 3e6, 4e9]))
        sigma = draw(st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]))
        parts.append(np.exp(rng.normal(math.log(median), sigma, n)))
    x = np.concatenate(parts)
    quantum = draw(st.sampled_from([1, 1, 1000]))  # coarse timers: many equal values, flat densities
    return (np.rint(x / quantum) * quantum).astype(np.int64)


@PROPERTY
@given(groups(), st.sampled_from([KdeParams(), KdeParams(min_samples=1, min_log_gap=0.0, min_valley_z=0.0),
                                  KdeParams(grid_points=16, max_clusters=2)]))
def test_one_group_matches_the_numpy_statement(x: np.ndarray, p: KdeParams) -> None:
    assert_same(cluster_durations(x, p), ref_cluster_durations(x, p))


@PROPERTY
@given(st.lists(groups(), min_size=1, max_size=6), st.integers(0, 2**32 - 1))
def test_groups_of_a_window_match_the_numpy_statement(parts: list[np.ndarray], seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.array([-5, 0, 7, 2**40 + 3, 2**62, 11], dtype=np.int64), size=len(parts), replace=False)
    g = np.concatenate([np.full(a.size, i, dtype=np.int64) for a, i in zip(parts, ids, strict=True)])
    x = np.concatenate(parts)
    perm = rng.permutation(x.size)
    got = cluster_by_group(g[perm], x[perm])
    want = ref_cluster_by_group(g[perm], x[perm], KdeParams())
    assert [gid for gid, _ in got] == [gid for gid, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert_same(a, b)


def test_durations_beyond_the_packed_sort_fall_back_to_lexsort() -> None:
    x = np.array([2**61, 5, 2**61 - 1, 7, 3, 2**61], dtype=np.int64)
    g = np.array([0, 1, 0, 1, 2, 3], dtype=np.int64)
    got = cluster_by_group(g, x)
    want = ref_cluster_by_group(g, x, KdeParams())
    assert [gid for gid, _ in got] == [gid for gid, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert_same(a, b)


def test_dense_codes_are_ranks_of_the_distinct_ids() -> None:
    g = np.array([9, -3, 9, 2**62, -3, 0], dtype=np.int64)
    codes, uniq = dense_codes(g)
    assert uniq.tolist() == [-3, 0, 9, 2**62]
    assert uniq[codes].tolist() == g.tolist()


# -- a simulated job -------------------------------------------------------------------------------------


def _kernel_batches(fault: str, batch_events: int | None = None) -> list[KernelBatch]:
    spec = build_spec(f"golden-{fault}", 2, 2, 2, 30, fault)
    kw = {} if batch_events is None else {"batch_events": batch_events}
    return [r.record for r in JobSimulator(spec, **kw).records() if r.topic is Topic.KERNELS]


def test_every_window_of_a_simulated_job_matches_the_numpy_statement() -> None:
    s = Settings()
    buf = WindowBuffer(s.window_ns, s.allowed_lateness_ns)
    windows = []
    for i, b in enumerate(_kernel_batches("case3")):
        windows += buf.add(b, i).closed
    assert len(windows) >= 8
    for w in windows:
        gid = (w.kernel_id.astype(np.int64) << 32) | w.stream.astype(np.int64)
        got = cluster_by_group(gid, w.duration_ns)
        want = ref_cluster_by_group(gid, w.duration_ns, KdeParams())
        assert [g for g, _ in got] == [g for g, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert_same(a, b)


#: Summaries the router emitted (their Avro bytes, digested in emission order) before the core was compiled:
#: (summaries, events summarized, sha256) per simulated 2 x 2 x 2 job of 30 steps. Changed on purpose twice:
#: groups with a stray call at one end are clustered with the bandwidth of the rest (case1), and clusters are
#: split again inside with their own bandwidth (case1, case3, case5).
GOLDEN = {
    ("none", None): (120, 105840, "1c89c6ec534d0f6b4d6850433190712bfcb75d9855bd0cfc068dec5bf506d3cc"),
    ("case1", None): (360, 105840, "6437170024bf9e9ccf0147d8aa8efcea782554b60ac5913c747763d9504c365e"),
    ("case2", None): (120, 105840, "8761fe375690cb49b1977a7a1b2afc1ee62d07b1244bf76c07e1832a78856c6a"),
    ("case3", None): (120, 105840, "5c1e524a42228d2ff89e711145427857290e8d06d9028f4010a6e7354d012eed"),
    ("case4", None): (120, 105840, "af96ae7a447ebae4e4e34ead03a26f985b0cab76f3eb2a08c00f23b1065a8216"),
    ("case5", None): (120, 105840, "3ac88f4a68165532fc2349fa111529d95498955b951e679cf7b8dddc773b38bd"),
    ("case3", 97): (120, 105840, "c240823c304c0867710aaf1c5def3af76b05dcd8efd432919aeb60167dcd654a"),
}


@pytest.mark.parametrize(("fault", "batch_events"), list(GOLDEN))
def test_router_emits_the_same_summaries_as_before(fault: str, batch_events: int | None) -> None:
    s = Settings()
    router: CompressionRouter[int] = CompressionRouter(s.worker, s.detector)
    h = hashlib.sha256()
    n_summaries = n_events = 0
    batches = _kernel_batches(fault, batch_events)
    routed = []
    for off, b in enumerate(batches):
        decoded = KernelBatch.decode(b.encode())  # the agent's decode, as on the wire
        now_ns = int(decoded.start_ns.min()) if len(decoded) else 0
        routed.append(router.take(decoded, off, 0, off, 0.0, now_ns))
        if routed[-1].emission is not None:
            router.delivered(routed[-1].emission)
    routed.append(router.take(KernelBatch.job_end_marker(batches[0].job_id), -1, 0, len(batches), 0.0, 0))
    for r in routed:
        for summary in r.emission.summaries if r.emission is not None else ():
            h.update(summary.encode())
            n_summaries += 1
            n_events += sum(summary.n_events)
    assert (n_summaries, n_events, h.hexdigest()) == GOLDEN[(fault, batch_events)]


# -- packed columns: compiled decoding against the numpy statement ---------------------------------------

_I64 = st.integers(-(2**63), 2**63 - 1)


@PROPERTY
@given(st.lists(st.tuples(_I64, st.integers(0, 5), st.integers(0, 2**40)), max_size=300),
       st.sampled_from([0, 1, 70_000]))
def test_compiled_column_decoding_matches_the_numpy_statement(rows: list[tuple[int, int, int]], stride: int
                                                              ) -> None:
    values = np.array([r[0] for r in rows], dtype=np.int64)
    groups = np.array([r[1] * stride for r in rows], dtype=np.int64)  # stride 70,000: too wide, numpy path
    after = np.array([r[2] for r in rows], dtype=np.int64)
    offset, gap = column_packing.pack_column(values), column_packing.pack_column(values, groups, after)
    got = (column_packing.unpack_column(offset, "v"), column_packing.unpack_column(gap, "v", groups, after))
    original = column_packing._compiled
    column_packing._compiled = lambda *args: None  # type: ignore[assignment]
    try:
        want = (column_packing.unpack_column(offset, "v"), column_packing.unpack_column(gap, "v", groups, after))
    finally:
        column_packing._compiled = original  # type: ignore[assignment]
    assert got[0].tolist() == want[0].tolist() == values.tolist()
    assert got[1].tolist() == want[1].tolist() == values.tolist()


def test_compiled_column_decoding_rejects_a_patch_beyond_the_column() -> None:
    data = bytearray(column_packing.pack_column(np.array([0, 1, 2**40], dtype=np.int64)))
    data[-12:-8] = (7).to_bytes(4, "little")  # the patch's event index
    with pytest.raises(SchemaError, match="patch of event 7"):
        column_packing.unpack_column(bytes(data), "v")


@PROPERTY
@given(st.lists(st.integers(0, 2**62), max_size=3000), st.integers(0, 62))
def test_radix_sort_sorts(values: list[int], bits: int) -> None:
    keys = np.array(values, dtype=np.int64) & ((1 << bits) - 1)
    assert radix_sort(keys, bits).tolist() == np.sort(keys).tolist()
