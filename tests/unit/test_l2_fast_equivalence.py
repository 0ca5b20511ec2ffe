"""L2's group comparison, every group of a phase at once (argus.detectors.l2_compare), against a plain loop over
the groups that re-states it with the statistics module (issue 10): the same flags in the same order, and
detect_l2 with either gives the same findings."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.detectors import l2_phases
from argus.detectors.l2_compare import Flag, phase_flags
from argus.detectors.l2_groups import cell_median
from argus.detectors.l2_phases import L2Params, L2Result, PhaseTable, detect_l2
from argus.producers.topology import build_topology
from argus.schemas.records import ParallelGroup, PhaseKind
from tests.unit.test_l3_fast_equivalence import same_values

PROPERTY = settings(max_examples=60, deadline=None)


def _loo(values: list[float]) -> list[float]:
    return [statistics.median(values[:i] + values[i + 1:]) for i in range(len(values))]


def ref_phase_flags(name: str, kind: PhaseKind, label: str, column: np.ndarray, has: np.ndarray, per_step: np.ndarray,
                    occ: np.ndarray, longest: np.ndarray, in_blocking: np.ndarray, rank: np.ndarray,
                    p: L2Params, raw: np.ndarray | Callable[[np.ndarray], np.ndarray] | None = None,
                    ratios: np.ndarray | None = None) -> list[Flag]:
    """Group by group (ascending), member by member: ratio and robust z against the others' median; a compute
    phase only where its duration (``raw``) exceeds the others' median by half its own excess at least. Each
    member's ratio is written into ``ratios`` where given."""
    raw = raw(np.arange(column.size)) if callable(raw) else raw
    out = []

    def group_values(members: list[int]) -> tuple[list[float], list[float], bool]:
        rates = [float(occ[i]) for i in members]
        per_occ = max(rates) - min(rates) > 0.01 * max(rates)
        values = [float(per_step[i]) / (r if per_occ else 1.0) for i, r in zip(members, rates, strict=True)]
        return values, rates, per_occ

    groups = {g: [i for i in range(column.size) if has[i] and column[i] == g]
              for g in sorted(set(column[has].tolist()))}
    # Two-member groups of a collective: each pair's difference against the other pairs' (l2_compare.pair_outliers).
    pairs = {g: group_values(m)[0] for g, m in groups.items() if len(m) == 2}
    diffs = {g: abs(v[0] - v[1]) for g, v in pairs.items()}
    bar = max(5.5, statistics.NormalDist().inv_cdf(1.0 - 0.01 / (2 * len(pairs)))) if pairs else math.inf
    for g, members in groups.items():
        if len(members) < 2:
            continue
        values, rates, per_occ = group_values(members)
        pair_z = math.nan
        if kind.is_collective and len(members) == 2 and len(pairs) >= 3:
            others = statistics.median([d for h, d in diffs.items() if h != g])
            scale = max(1.4826 * others, p.mad_floor * statistics.median(values))
            pair_z = diffs[g] / scale if scale else (math.inf if diffs[g] else math.nan)
        peers = _loo(values)
        mid = statistics.median(values)
        mad = statistics.median([abs(v - mid) for v in values]) * 1.4826
        mean = statistics.fmean(values)
        cv = statistics.pstdev(values) / mean if mean > 0 else 0.0
        waits = [float(in_blocking[i]) for i in members]
        wait_peers = _loo(waits)
        walls = values if raw is None else [float(raw[i]) / (r if per_occ else 1.0)
                                            for i, r in zip(members, rates, strict=True)]
        wall_peers = _loo(walls)
        for j, i in enumerate(members):
            v, pm = values[j], peers[j]
            scale = max(mad, p.mad_floor * pm)
            z = (v - pm) / scale if scale else math.copysign(math.inf, v - pm) if v != pm else math.nan
            ratio = max(v, 1.0) / max(pm, 1.0)  # times below 1 ns are no time measured
            if ratios is not None:
                ratios[i] = ratio
            if kind.is_collective:
                hit = ratio <= 0.5 and (z <= -p.min_z if len(members) >= 3 else
                                        len(pairs) < 3 or (math.isfinite(pair_z) and pair_z >= bar)
                                        or pair_z == math.inf)
            else:
                hit = (ratio >= p.min_elevation and (len(members) < 3 or z >= p.min_z)
                       and walls[j] - wall_peers[j] >= 0.5 * (v - pm))
            if not hit:
                continue
            late_ns = (pm - v) * (rates[j] if per_occ else 1.0)
            zi = (z if len(members) >= 3 else -pair_z if kind.is_collective else math.nan)
            zi = zi if math.isfinite(zi) else None
            out.append(Flag(int(rank[i]), name, kind, ratio, zi, v, pm, cv, f"{label}{g}",
                            late_ns / max(float(longest[i]), 1.0), (waits[j] - wait_peers[j]) / max(late_ns, 1.0),
                            late_ns if kind.is_collective else -late_ns))
    return out


def _flags_same(fast: list[Flag], want: list[Flag]) -> None:
    assert [(f.rank, f.phase, f.kind, f.group) for f in fast] == [(f.rank, f.phase, f.kind, f.group) for f in want]
    for f, w in zip(fast, want, strict=True):
        same_values([f.ratio, f.z, f.value_ns, f.peers_ns, f.cv, f.late_fraction, f.waited_fraction, f.excess_ns],
              [w.ratio, w.z, w.value_ns, w.peers_ns, w.cv, w.late_fraction, w.waited_fraction, w.excess_ns],
                    abs_tol=1e-12)


def _results_same(fast: list[L2Result], want: list[L2Result]) -> None:
    assert [(r.kind, r.ranks, r.phase, r.steps_affected) for r in fast] == [
        (r.kind, r.ranks, r.phase, r.steps_affected) for r in want]
    for f, w in zip(fast, want, strict=True):
        same_values([f.score, f.delay_ns_per_step, f.evidence], [w.score, w.delay_ns_per_step, w.evidence],
                    abs_tol=1e-12)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 80), collective=st.booleans())
def test_phase_flags_match_the_per_group_loop(seed: int, n: int, collective: bool) -> None:
    rng = np.random.default_rng(seed)
    column = rng.integers(0, max(1, n // int(rng.integers(1, 9))), n)
    has = rng.random(n) < rng.choice([0.7, 1.0])
    base = rng.choice([1e3, 1e6, 1e9])
    per_step = base * np.exp(rng.normal(0.0, rng.choice([0.0, 0.01, 0.3]), n))
    slow = rng.random(n) < 0.1
    per_step[slow] *= rng.choice([0.2, 0.4, 1.6, 3.0], int(slow.sum()))
    per_step[rng.random(n) < 0.1] = base  # ties
    occ = rng.choice([1.0, 1.0, 2.0, 0.5], n) if rng.random() < 0.3 else np.ones(n)
    longest = per_step * rng.uniform(1.0, 5.0, n)
    in_blocking = rng.uniform(0.0, base, n)
    rank = np.arange(n) + 100
    kind = PhaseKind.ALL_REDUCE if collective else PhaseKind.FORWARD
    label = "TP" if collective else "DP"
    # Durations: the own time plus what nested in it (nothing, a little, or as much as the phase).
    raw = per_step + rng.choice([0.0, 0.1, 1.0]) * base * rng.random(n)
    args = ("ph", kind, label, column, has, per_step, occ, longest, in_blocking, rank, L2Params())
    fast_ratios, want_ratios = np.full(n, np.nan), np.full(n, np.nan)
    _flags_same(phase_flags(*args, raw.__getitem__, fast_ratios), ref_phase_flags(*args, raw, want_ratios))
    np.testing.assert_allclose(fast_ratios, want_ratios, rtol=1e-9)


def _table(seed: int) -> tuple[PhaseTable, Any]:
    """A job's phases over a few steps: compute phases (one slow rank at times), TP and PP collectives (a late
    arrival at times), a host phase, ranks missing phases, occurrences differing by stage."""
    rng = np.random.default_rng(seed)
    topo = build_topology("j", int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4])))
    n = topo.world_size
    phases = [("fwd", PhaseKind.FORWARD, ParallelGroup.NONE), ("bwd", PhaseKind.BACKWARD, ParallelGroup.NONE),
              ("tp-ar", PhaseKind.ALL_REDUCE, ParallelGroup.TP), ("pp", PhaseKind.SEND_RECV, ParallelGroup.PP),
              ("dp-ar", PhaseKind.ALL_REDUCE, ParallelGroup.DP), ("data", PhaseKind.DATA_LOADER, ParallelGroup.NONE)]
    scale = np.exp(rng.normal(0.0, rng.choice([0.0, 0.01, 0.05]), (n, len(phases))))
    slow, late = int(rng.integers(0, n)), int(rng.integers(0, n))
    if rng.random() < 0.6:
        scale[slow, :2] *= rng.uniform(1.2, 3.0)
    if rng.random() < 0.6:
        scale[late, 2:4] /= rng.uniform(1.5, 5.0)
    cols: dict[str, list[int]] = {"rank": [], "step": [], "phase": [], "dur": [], "count": []}
    for step in range(int(rng.integers(1, 6))):
        for r in range(n):
            for k in range(len(phases)):
                if rng.random() < 0.05:
                    continue  # a phase missing on a rank in a step
                count = 2 if k == 3 and topo.pp_stage[r] in (0, max(topo.pp_stage)) else 4 if k == 3 else 1
                cols["rank"].append(r)
                cols["step"].append(step)
                cols["phase"].append(k)
                cols["count"].append(count)
                cols["dur"].append(max(1, round(1e6 * (k + 1) * count * scale[r, k] * math.exp(rng.normal(0, 0.01)))))
    table = PhaseTable(*(np.array(cols[c], dtype=np.int64) for c in ("rank", "step", "phase", "dur", "count")),
                       tuple(x[0] for x in phases), tuple(x[1] for x in phases), tuple(x[2] for x in phases))
    return table, topo


@pytest.mark.parametrize("seed", range(60))
def test_detect_l2_finds_the_same_as_the_per_group_loop(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    table, topo = _table(seed)
    onset = None if seed % 3 else 1
    fast = detect_l2(table, topo, onset_step=onset)
    with monkeypatch.context() as m:
        m.setattr(l2_phases, "phase_flags", ref_phase_flags)
        want = detect_l2(table, topo, onset_step=onset)
    _results_same(fast, want)


def test_detect_l2_cases_include_findings() -> None:
    kinds = {r.kind for seed in range(60) for r in detect_l2(*_table(seed))}
    assert l2_phases.FindingKind.COMPUTE_STRAGGLER in kinds


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 40), per=st.integers(1, 12), ragged=st.booleans())
def test_cell_median_matches_per_cell_medians(seed: int, size: int, per: int, ragged: bool) -> None:
    """Cells of equal counts (runs per step, the usual table) and of unequal counts; empty cells are NaN."""
    rng = np.random.default_rng(seed)
    filled = np.flatnonzero(rng.random(size) < 0.8)
    cell = np.concatenate([rng.permutation(filled) for _ in range(per)]) if filled.size else np.empty(0, np.int64)
    if ragged and cell.size:
        cell = cell[rng.random(cell.size) < 0.7]
    values = rng.choice([0.0, 1.0, 5.0, 1e9], cell.size) if rng.random() < 0.3 else np.rint(rng.random(cell.size) * 1e6)
    got = cell_median(cell.astype(np.int64), values.astype(np.float64), size)
    for k in range(size):
        in_cell = values[cell == k].tolist()
        assert (math.isnan(got[k]) if not in_cell else got[k] == statistics.median(in_cell)), (k, got[k], in_cell)
