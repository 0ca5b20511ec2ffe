"""The folded phase history (argus.detectors.l2_history) against a table built from all held batches at once:
the same detect_l2 findings, with duplicates, out-of-order and late delivery, layouts that change."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.kinds import FindingKind
from argus.detectors.l2_history import PhaseHistory
from argus.detectors.l2_phases import L2Params, L2Result, PhaseTable, detect_l2
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology, ParallelGroup, PhaseBatch, PhaseKind, Step
from argus.streams.diagnosis import DiagnosisParams, JobDiagnosis, judge

PROPERTY = settings(max_examples=40, deadline=None)
F, B, AR, SR = PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.ALL_REDUCE, PhaseKind.SEND_RECV
N, TP, PP, DP = ParallelGroup.NONE, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.DP


def _batch(rng: np.random.Generator, topo: JobTopology, rank: int, step: int, slow: int, odd: bool) -> PhaseBatch:
    """A layer-like batch: forward around two TP all-reduces, a backward, pipeline and DP collectives; the
    last stage runs an extra phase; ``odd`` adds a host phase (a layout that changes between steps)."""
    stage = topo.pp_stage[topo.rank.index(rank)]
    phases = [("fwd", F, N), ("attn", F, N), ("tp-ar", AR, TP), ("mlp", F, N), ("tp-ar", AR, TP),
              ("bwd", B, N), ("pp", SR, PP), ("dp-ar", AR, DP)]
    if stage == max(topo.pp_stage):
        phases.insert(5, ("loss", F, N))
    if odd:
        phases.append(("data", PhaseKind.DATA_LOADER, N))
    t, starts, durs = 1_000_000 * step, [], []
    base = {"fwd": 0}
    for name, kind, _ in phases:
        d = int(rng.integers(900, 1100)) * (3 if rank == slow and kind in (F, B) else 1) * 1000
        if kind is AR and rank == slow:
            d //= 4
        starts.append(base.get(name, t) + 1_000_000 * step if name == "fwd" else t)
        durs.append(d if name != "fwd" else 5_000_000)
        t += d if name != "fwd" else 1000
    return PhaseBatch("j", rank, step, tuple(k for _, k, _ in phases), tuple(n for n, _, _ in phases),
                      tuple(g for _, _, g in phases), tuple(-1 for _ in phases), tuple(starts), tuple(durs))


def _deliveries(seed: int, topo: JobTopology, steps: int) -> list[PhaseBatch]:
    """Every rank's batch of every step, some twice (different times), shuffled across neighbouring steps."""
    rng = np.random.default_rng(seed)
    slow = int(rng.choice(topo.rank))
    out: list[tuple[float, PhaseBatch]] = []
    for s in range(steps):
        odd_ranks = set(rng.choice(topo.rank, size=int(rng.integers(0, 2)), replace=False).tolist())
        for r in topo.rank:
            out.append((s + rng.random() * 3, _batch(rng, topo, r, s, slow, r in odd_ranks)))
            if rng.random() < 0.15:  # a duplicate, maybe after the step completed
                out.append((s + rng.random() * 6, _batch(rng, topo, r, s, slow, rng.random() < 0.3)))
    out.sort(key=lambda x: x[0])
    return [b for _, b in out]


def _same(got: list[L2Result], want: list[L2Result]) -> None:
    assert repr(got) == repr(want)


@pytest.mark.slow
@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), cap=st.integers(3, 8), onset=st.sampled_from([None, 2, 5]),
       shape=st.sampled_from([(2, 2, 2), (4, 2, 1), (3, 1, 2), (2, 4, 2)]))
def test_history_gives_the_findings_of_the_table_of_all_held_batches(seed: int, cap: int, onset: int | None,
                                                                     shape: tuple[int, int, int]) -> None:
    topo = build_topology("j", *shape)
    params = L2Params()
    hist = PhaseHistory(cap)
    pending: dict[int, dict[int, PhaseBatch]] = {}
    held: dict[int, dict[int, PhaseBatch]] = {}  # the reference: decoded batches of the held steps
    complete: list[int] = []
    for b in _deliveries(seed, topo, 10):
        if b.step in complete:
            if b.step in held:
                held[b.step][b.rank] = b
                hist.replace(b)
            continue
        pending.setdefault(b.step, {})[b.rank] = b
        if len(pending[b.step]) == topo.world_size:
            complete = sorted([*complete, b.step])
            batches = pending.pop(b.step)
            for old in complete[:-cap]:
                held.pop(old, None)
                hist.drop(old)
            if b.step in complete[-cap:]:
                held[b.step] = batches
                hist.fold(b.step, list(batches.values()))
        assert hist.steps() == sorted(held)
        if held and b.rank == 0:
            table = PhaseTable.from_batches([x for s in sorted(held) for x in held[s].values()])
            _same(hist.detect(topo, params, onset), detect_l2(table, topo, params, onset_step=onset))


@pytest.mark.parametrize("long_rank", [0, 7])
def test_times_beyond_int32_widen_the_held_steps(long_rank: int) -> None:
    """A step whose phase takes over 2**31 ns (~2.1 s) on one rank, folded among steps of int32 times (the rank's
    layout written first or last): every held time kept exactly, the findings the table's."""
    topo = build_topology("j", 2, 2, 2)
    rng = np.random.default_rng(5)
    by_step = {s: {r: _batch(rng, topo, r, s, 3, False) for r in topo.rank} for s in range(5)}
    b = by_step[3][long_rank]
    by_step[3][long_rank] = dataclasses.replace(b, duration_ns=(b.duration_ns[0], 3_000_000_000, *b.duration_ns[2:]))
    arrival = sorted(topo.rank, key=lambda r: (r != long_rank, r))  # which layout is folded first
    hist = PhaseHistory(8)
    for s in sorted(by_step):
        hist.fold(s, [PhaseBatch.decode(by_step[s][r].encode()) for r in arrival])
    shape = hist._pieces[0].shape
    assert all(p.shape is shape for p in hist._pieces.values())  # one matrix, widened in step 3
    assert shape.mat.dtype == np.int64 and int(shape.mat.max()) >= 3_000_000_000
    table = PhaseTable.from_batches([x for s in sorted(by_step) for x in by_step[s].values()])
    _same(hist.detect(topo, L2Params()), detect_l2(table, topo, L2Params()))
    for s in sorted(by_step):  # each step's column holds its own times, whatever was widened around it
        one = PhaseHistory(1)
        one.fold(s, [by_step[s][r] for r in arrival])
        assert one._pieces[s].column.tolist() == hist._pieces[s].column.tolist()


def test_history_cases_include_findings() -> None:
    topo = build_topology("j", 4, 2, 2)
    hist = PhaseHistory(8)
    by_step: dict[int, dict[int, PhaseBatch]] = {}
    for b in _deliveries(3, topo, 6):
        by_step.setdefault(b.step, {})[b.rank] = b
    for s, batches in by_step.items():
        hist.fold(s, list(batches.values()))
    found = hist.detect(topo, L2Params())
    assert FindingKind.COMPUTE_STRAGGLER in {r.kind for r in found}
    assert hist.state_bytes() < 2000 * topo.world_size * len(by_step)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), history=st.integers(3, 7))
def test_job_diagnosis_l2_matches_the_table_of_its_held_steps(seed: int, history: int) -> None:
    """JobDiagnosis (folding each complete step once) against detect_l2 over a table of the batches it held
    before folding was introduced (the last of each (rank, step) among the last ``history_steps`` steps)."""
    topo = build_topology("j", 2, 2, 2)
    params = DiagnosisParams(history_steps=history)
    jd = JobDiagnosis("j", params)
    jd.add(topo)
    held: dict[int, dict[int, PhaseBatch]] = {}
    for s in range(10):
        for r in topo.rank:
            jd.add(Step("j", r, s, 10_000_000 * s, 10_000_000, 9_000_000))
    for b in _deliveries(seed, topo, 10):
        held.setdefault(b.step, {})[b.rank] = b
        jd.add(b)
    window = sorted(held)[-history:]
    table = PhaseTable.from_batches([x for s in window for x in held[s].values()])
    want = judge("j", list(detect_l2(table, topo, params.l2)), jd.last_time_ns, topo.world_size, jd.clock(),
                 params.min_impact_fraction)
    got = [f for f in jd.diagnose() if f.level.value == "L2"]
    assert [f.finding_id for f in got] == [f.finding_id for f in want if f.level.value == "L2"]
    assert got == [f for f in want if f.level.value == "L2"]
