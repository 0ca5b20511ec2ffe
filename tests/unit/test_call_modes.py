"""Call modes: the calls a slowdown that began inside the traced steps moved, and the share of the steps it was
spent in (argus.detectors.call_modes, KernelTotals.moved_calls, StepClock.affected_steps, the job context)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.detectors.call_modes import CallCensus, ModeParams, affected_share, moved_calls
from argus.detectors.impact import StepClock
from argus.detectors.kernel_excess import detect_kernel_excess
from argus.detectors.l3_ranks import KernelTotals
from argus.schemas.job_context import JobContext
from argus.schemas.records import KernelSummary
from argus.streams.diagnosis import RankDiagnosis
from argus.streams.job_context import context_totals, totals_context

P = ModeParams()


def _census(clusters: dict[int, list[tuple[float, float]]]) -> CallCensus:
    """rank -> its clusters (median ns, calls) as a census."""
    out = CallCensus()
    for r, cl in clusters.items():
        out.add([r] * len(cl), [a for a, _ in cl], [n for _, n in cl])
    return out


def test_a_mode_moved_from_step_5_of_12_reads_as_7_of_12() -> None:
    # A two-shape kernel, 12 calls a step of each; rank 0's second shape x1.21 from step 5 on (a new cluster).
    census = _census({0: [(527e3, 143), (1570e3, 61), (1913e3, 84)], 1: [(525e3, 144), (1577e3, 144)],
                      2: [(522e3, 144), (1567e3, 144)]})
    assert moved_calls(census, P) == {0: (83.0, 144.0)}
    assert affected_share([(83.0, 144.0)]) == pytest.approx(7 / 12, abs=0.01)
    # Of two ranks the other one is the reference: it moved nothing (it lacks no calls).
    two = _census({0: [(527e3, 143), (1570e3, 61), (1913e3, 84)], 1: [(525e3, 144), (1577e3, 144)]})
    assert moved_calls(two, P) == {0: (83.0, 144.0)}
    # Added in any batches, joined with another census: the same counts.
    parts = [_census({0: [(527e3, 143), (1570e3, 61)], 1: [(525e3, 144)]}),
             _census({0: [(1913e3, 84)], 1: [(1577e3, 144)]})]
    joined = CallCensus()
    for part in parts:
        joined.merge(part)
    assert moved_calls(joined, P) == {0: (83.0, 144.0)} and len(joined) == 5


def test_a_slowdown_from_the_start_moves_every_call_of_its_modes() -> None:
    census = _census({0: [(527e3, 144), (1913e3, 144)], 1: [(525e3, 144), (1577e3, 144)],
                      2: [(522e3, 144), (1567e3, 144)]})
    assert moved_calls(census, P) == {0: (144.0, 144.0)} and affected_share([(144.0, 144.0)]) == 1.0


def test_hiccups_calls_gone_down_and_other_work_are_no_moves() -> None:
    peers: dict[int, list[tuple[float, float]]] = {1: [(525e3, 144), (1577e3, 144)],
                                                   2: [(522e3, 144), (1567e3, 144)]}
    hiccups = _census({0: [(527e3, 144), (1570e3, 141), (4100e3, 3)], **peers})
    faster = _census({0: [(527e3, 144), (1570e3, 61), (1100e3, 83)], **peers})
    fewer = _census({0: [(527e3, 144), (1570e3, 61)], **peers})  # calls missing, not moved up
    assert moved_calls(hiccups, P) == moved_calls(faster, P) == moved_calls(fewer, P) == {}
    # Ranks of other calls (another pipeline stage's layers) are not one another's peers.
    stages = _census({0: [(527e3, 72), (1913e3, 72)], 1: [(525e3, 144), (1577e3, 144)],
                      2: [(522e3, 144), (1567e3, 144)], 3: [(526e3, 72), (1572e3, 72)]})
    assert moved_calls(stages, P) == {0: (72.0, 72.0)}
    assert affected_share([]) == affected_share([None]) == 1.0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 2**32 - 1), jitter=st.floats(0.0, 0.015))
def test_healthy_ranks_of_jittered_modes_move_nothing(n: int, seed: int, jitter: float) -> None:
    rng = np.random.default_rng(seed)
    shapes = np.array([1e5, 1.3e5, 4e5, 9e5])
    census = _census({r: [(float(s), 144.0) for s in shapes * np.exp(jitter * rng.standard_normal(4))]
                      for r in range(n)})
    assert moved_calls(census, P) == {}


def test_params_are_validated() -> None:
    for bad in ({"resolution": 1e-5}, {"resolution": 0.1, "tolerance": 0.05}, {"min_share": 1.0},
                {"min_landed": 0.0}, {"min_calls": 0.5}, {"same_calls": 1.0}):
        with pytest.raises(DetectorError):
            ModeParams(**bad)


def _summary(rows: dict[int, list[tuple[float, int]]], kernel: str = "gemm") -> KernelSummary:
    ranks = sorted(rows)
    cl = [c for r in ranks for c in rows[r]]
    p50 = tuple(round(a) for a, _ in cl)
    return KernelSummary(job_id="j", kernel=kernel, stream=7, rank=tuple(ranks), window_start_ns=(0,) * len(ranks),
                         window_end_ns=(10,) * len(ranks), n_events=tuple(sum(n for _, n in rows[r]) for r in ranks),
                         n_clusters=tuple(len(rows[r]) for r in ranks), cluster_count=tuple(n for _, n in cl),
                         cluster_p50_ns=p50, cluster_p99_ns=tuple(round(a * 1.05) for a in p50),
                         cluster_min_ns=tuple(round(a * 0.95) for a in p50),
                         cluster_max_ns=tuple(round(a * 1.06) for a in p50),
                         cluster_sum_ns=tuple(round(a * n) for a, n in cl))


def test_totals_keep_the_census_over_windows_and_a_context_carries_the_moves() -> None:
    t = KernelTotals("gemm", 7)
    # Window 1: before the onset; window 2: rank 0's second mode moved half way through (a new cluster).
    t.add(_summary({r: [(500e3, 60), (1500e3, 60)] for r in range(4)}))
    t.add(_summary({0: [(500e3, 60), (1500e3, 20), (1900e3, 40)], **{r: [(505e3, 60), (1490e3, 60)]
                                                                       for r in (1, 2, 3)}}))
    assert t.census is not None and t.moved_calls() == {0: (40.0, 120.0)}  # a third of the job's calls of the mode
    back = context_totals(JobContext.decode(totals_context("j", 0, 5, [t]).encode()))[0]
    assert back.census is None and back.moved_calls() == {0: (40.0, 120.0)}
    # Merged with another part read from a context, the moves add up; with a census, the censuses do.
    merged = KernelTotals("gemm", 7)
    merged.merge(back)
    merged.merge(dataclasses.replace(back, moved={0: (10.0, 20.0)}))
    assert merged.moved_calls() == {0: (50.0, 140.0)}
    both = KernelTotals("gemm", 7)
    both.merge(t)
    assert both.census is not None and both.moved_calls() == t.moved_calls()


def test_the_share_spreads_the_excess_over_the_affected_steps_only() -> None:
    starts = tuple(range(0, 1200, 100))
    clock = StepClock(starts, 100.0)
    assert clock.affected_steps((3,), -1, 10_000, 7 / 12) == 7 and clock.affected_steps((3,), -1, 10_000) == 12
    assert clock.affected_steps((3,), -1, 10_000, 0.01) == 1
    # An onset found in the phases stands before the share.
    late = dataclasses.replace(clock, onsets=((3, 900),))
    assert late.affected_steps((3,), -1, 10_000, 7 / 12) == 3


def _late_mode_job(onset_share: float, n_ranks: int = 8, steps: int = 12) -> RankDiagnosis:
    """A job of ``n_ranks`` ranks and ten kernels of two modes, 12 calls a step each; rank 5's second mode of
    kernel 3 runs x1.4 from ``onset_share`` of the steps on (one window)."""
    rng = np.random.default_rng(3)
    job = RankDiagnosis("j")
    for k in range(10):
        base = float(rng.lognormal(np.log(2e5), 0.5))
        rows: dict[int, list[tuple[float, int]]] = {}
        for r in range(n_ranks):
            a, b = base * float(np.exp(0.01 * rng.standard_normal())), 3 * base * float(
                np.exp(0.01 * rng.standard_normal()))
            calls = 12 * steps
            if (r, k) == (5, 3):
                before = round(calls * onset_share)
                rows[r] = [(a, calls), (b, before), (1.4 * b, calls - before)] if before else [(a, calls),
                                                                                             (1.4 * b, calls)]
            else:
                rows[r] = [(a, calls), (b, calls)]
        job.add(_summary(rows, f"sm90_xmma_gemm_{k}"))
    return job


@pytest.mark.parametrize(("onset", "steps"), [(0.0, 12), (5 / 12, 7), (0.5, 6)])
def test_a_kernel_slowed_from_inside_the_steps_costs_the_affected_steps(onset: float, steps: int) -> None:
    job = _late_mode_job(onset)
    res = detect_kernel_excess(job.totals())
    assert [r.ranks for r in res] == [(5,)]
    assert res[0].affected_share == pytest.approx(1.0 - onset) and res[0].evidence["affected_share"] == \
        res[0].affected_share
    clock = StepClock(tuple(range(0, 12_000, 1000)), 1000.0)
    found = [f for f in job.diagnose(None, clock) if f.ranks == (5,)]
    assert len(found) == 1 and found[0].evidence["impact_steps"] == steps
