"""Late onsets: a rank that slowed down part way through its steps has its excess spread over the affected
steps only (argus.detectors.onsets, StepClock.affected_steps, streams.diagnosis.judge)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.impact import StepClock
from argus.detectors.l3_kernels import L3Result
from argus.detectors.onsets import OnsetParams, rank_onsets
from argus.streams.diagnosis import judge


def _own(n_ranks: int, n_steps: int, seed: int, noise: float = 0.01) -> np.ndarray:
    """Own compute time (ns) per rank and step: a per-rank level, a per-step level every rank shares (the
    step's length), and per (rank, step) noise."""
    rng = np.random.default_rng(seed)
    level = rng.lognormal(np.log(5e6), 0.05, (n_ranks, 1))
    shared = rng.lognormal(0.0, 0.05, (1, n_steps))
    return level * shared * rng.lognormal(0.0, noise, (n_ranks, n_steps))


@settings(max_examples=40, deadline=None)
@given(n_ranks=st.integers(8, 64), n_steps=st.integers(10, 40), frac=st.floats(0.0, 1.0),
       shift=st.floats(1.08, 1.5), seed=st.integers(0, 100_000))
def test_a_shift_part_way_is_found_at_its_step(n_ranks: int, n_steps: int, frac: float, shift: float,
                                               seed: int) -> None:
    own = _own(n_ranks, n_steps, seed)
    seg = OnsetParams().min_segment
    onset = seg + 1 + round(frac * (n_steps - 2 * seg - 1))
    own[1, onset:] *= shift
    found = rank_onsets(own)
    assert abs(int(found[1]) - onset) <= 1
    assert (np.delete(found, 1) == -1).all()


@pytest.mark.parametrize("onset", [1, 2, 3, 4])
def test_an_onset_too_early_to_resolve_is_none_never_a_later_one(onset: int) -> None:
    # Found later than it was, an onset would spread the excess over too few steps (too much impact).
    for seed in range(10):
        own = _own(16, 20, seed)
        own[2, onset:] *= 1.3
        found = int(rank_onsets(own)[2])
        assert found == -1 or found <= onset + 1


@pytest.mark.parametrize("seed", range(30))
def test_no_onset_in_noise_or_a_rank_slow_from_the_start(seed: int) -> None:
    own = _own(32, 20, seed, noise=0.02)
    own[3] *= 1.3  # slow in every step: no onset
    assert (rank_onsets(own) == -1).all()


@pytest.mark.parametrize("seed", range(20))
def test_one_outlier_step_near_the_end_is_no_onset(seed: int) -> None:
    # A host stall or a pause lengthens a few ranks' phases in one step; in a short last segment it would
    # move the mean, not the level.
    own = _own(32, 30, seed)
    own[[4, 9], 25] *= 3.0
    assert (rank_onsets(own) == -1).all()


def test_phases_are_compared_with_their_own_kind_and_gaps_are_skipped() -> None:
    fwd, bwd = _own(8, 16, 1), 2.0 * _own(8, 16, 2)
    own = np.vstack([fwd, bwd])
    phase = np.repeat([0, 1], 8)
    own[9, 10:] *= 1.2  # rank 1's backward
    own[0, 4] = np.nan  # a step one rank did not report is left out
    found = rank_onsets(own, phase)
    assert found[9] == 10 and (np.delete(found, 9) == -1).all()
    assert (rank_onsets(own[:, :7], phase) == -1).all()  # too few steps for two segments
    with pytest.raises(DetectorError):
        rank_onsets(own, phase[:3])
    with pytest.raises(DetectorError):
        OnsetParams(min_segment=1)


@pytest.mark.parametrize("bad", [0.0, -2e-3, float("nan"), float("inf")])
def test_bad_noise_floor_raises(bad: float) -> None:
    with pytest.raises(DetectorError, match="noise_floor"):
        OnsetParams(noise_floor=bad)


def _result(ranks: tuple[int, ...], excess_ms: float) -> L3Result:
    return L3Result(FindingKind.KERNEL_DEGRADED, ranks, "gemm", 7, 0.2, {}, excess_ns=excess_ms * 1e6)


def test_the_excess_spreads_over_the_steps_from_the_onset() -> None:
    starts = tuple(1_000 + 10_000_000 * i for i in range(12))  # 12 steps of 10 ms
    plain = StepClock(starts, 10e6)
    late = StepClock(starts, 10e6, onsets=((5, starts[6]), (7, starts[9])))
    window = (0, starts[-1] + 10_000_000)
    # 1.2 ms over 12 steps: 0.1 ms a step, 1 % of the step: raised at 1 %, not at 1.5 %.
    assert judge("j", [_result((5,), 1.2)], 0, 8, plain, 0.015, window) == []
    # From the onset (step 6 of 12) the same excess is 0.2 ms on each of 6 steps: raised.
    found = judge("j", [_result((5,), 1.2)], 0, 8, late, 0.015, window)
    assert len(found) == 1 and found[0].evidence["impact_steps"] == 6
    assert late.affected_steps((5,), *window) == 6 and late.affected_steps((5, 7), *window) == 6
    # A rank without an onset, a group with one member without, or an onset outside the span: every step.
    assert late.affected_steps((4,), *window) == 12 and late.affected_steps((4, 5), *window) == 12
    assert late.affected_steps((5,), starts[7], window[1]) == 5
    assert late.affected_steps((7,), starts[0], starts[8]) == 8
    # Job-wide results (no window) too.
    assert judge("j", [_result((5,), 1.2)], 0, 8, late, 0.015)[0].evidence["impact_steps"] == 6


def test_the_phase_history_gives_each_ranks_own_compute_time_per_step() -> None:
    from argus.detectors.l2_history import PhaseHistory
    from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind

    hist = PhaseHistory(16)
    kinds = (PhaseKind.FORWARD, PhaseKind.ALL_REDUCE, PhaseKind.BACKWARD, PhaseKind.ALL_REDUCE)
    groups = (ParallelGroup.NONE, ParallelGroup.TP, ParallelGroup.NONE, ParallelGroup.DP)
    for step in range(3):
        batches = []
        for rank in range(2):
            fwd = 1000 * (rank + 1) + step
            # forward [0, fwd) holds a blocking TP all-reduce of 100 ns: its own time is fwd - 100
            starts = (0, 10, fwd, fwd + 1)
            durs = (fwd, 100, 500, 50)
            batches.append(PhaseBatch("j", rank, step, kinds, ("forward", "tp", "backward", "dp"), groups,
                                      (7, 20, 7, 24), starts, durs))
        hist.fold(step, batches)
    steps, ranks, phases, own = hist.compute_own()
    assert steps == [0, 1, 2] and sorted(set(ranks.tolist())) == [0, 1]
    by = {(int(r), int(p)): own[i] for i, (r, p) in enumerate(zip(ranks, phases, strict=True))}
    fwd_id = min(int(p) for p in phases)  # the first phase seen has the first id
    for rank in range(2):
        assert by[(rank, fwd_id)].tolist() == [1000 * (rank + 1) + s - 100 for s in range(3)]
    assert len(by) == 4  # forward and backward of two ranks; collectives are not compute


def _collective_job(n_steps: int, onset: int, seed: int) -> tuple[object, list[int]]:
    """A DP4 x TP2 job that annotates its collectives only (no compute phases): from ``onset`` on, TP group
    [4, 5]'s all-reduce runs x1.4 (a degraded link: both members' collective time grows), and rank 2 arrives
    late (its own collectives shorten: it waits for nobody)."""
    from argus.producers.topology import build_topology
    from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind, Step
    from argus.streams.diagnosis import JobDiagnosis

    rng = np.random.default_rng(seed)
    topo = build_topology("j", 4, 2)
    job = JobDiagnosis("j")
    job.add(topo)
    starts = [1_000 + 50_000_000 * s for s in range(n_steps)]
    kinds = (PhaseKind.ALL_REDUCE, PhaseKind.REDUCE_SCATTER)
    for s in range(n_steps):
        shared = rng.lognormal(0.0, 0.03)
        for r in topo.rank:
            tp, dp = (1_000_000 * shared * rng.lognormal(0.0, 0.02, 2)).tolist()
            if s >= onset and r in (4, 5):
                tp *= 1.4
            if s >= onset and r == 2:
                tp, dp = 0.6 * tp, 0.6 * dp
            job.add(Step("j", r, s, starts[s], 50_000_000, 45_000_000))
            job.add(PhaseBatch("j", r, s, kinds, ("tp", "dp"), (ParallelGroup.TP, ParallelGroup.DP), (13, 17),
                               (starts[s] + 10, starts[s] + 40_000_000), (round(tp), round(dp))))
    return job, starts


@pytest.mark.parametrize("seed", range(5))
def test_a_degraded_links_onset_is_read_from_its_members_collective_phases(seed: int) -> None:
    # A job without compute phases has no own compute time to read an onset from, while a degraded link shows
    # in its members' collectives: their excess is spread over the steps from its onset, not every step. A
    # late arrival's collectives shorten: no onset.
    job, starts = _collective_job(24, 11, seed)
    assert job.clock().onsets == ((4, starts[11]), (5, starts[11]))  # type: ignore[attr-defined]
