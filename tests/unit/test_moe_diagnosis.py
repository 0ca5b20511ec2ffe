"""MoE jobs diagnosed end to end from generated Kineto traces (load_tests/kineto_scenarios.py through
argus.streams.offline.diagnose_traces): routed-token imbalance is no fault; a slow expert rank is named
with its grouped GEMMs, with and without token counts in the trace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from argus.streams.offline import diagnose_traces
from load_tests.kineto_scenarios import Scenario, simulate, write_scenario

#: Two expert groups of four (ranks 0-3, 4-7); every group's position 1 gets twice an even share of tokens.
SKEW = (2.0 / 3.0, 2.0, 2.0 / 3.0, 2.0 / 3.0)
BASE = Scenario(seed=5, fault="token_imbalance", dp=8, tp=1, pp=1, ep=4, moe=True, steps=10, microbatches=2,
                layers=2, hidden=4096, tokens=4096, noise=0.05, name_style="sm90", schedule="gpipe",
                expert_skew=SKEW, magnitude=2.0, annotate_phases=True)


def _findings(scn: Scenario, tmp_path: Path) -> list[dict[str, object]]:
    traces = write_scenario(scn, tmp_path, simulate(scn))
    return diagnose_traces(traces, "moe")


@pytest.mark.slow
@pytest.mark.parametrize("counts", [True, False])
@pytest.mark.parametrize("style", ["sm90", "sm80"])
def test_token_imbalance_is_no_finding(tmp_path: Path, counts: bool, style: str) -> None:
    scn = dataclasses.replace(BASE, token_counts=counts, name_style=style)
    assert _findings(scn, tmp_path) == []


@pytest.mark.parametrize("counts", [True, False])
def test_an_ep_straggler_is_named_with_its_grouped_gemm(tmp_path: Path, counts: bool) -> None:
    # Rank 6 (a cold expert of the second group) runs its grouped GEMMs 1.6x slower; rank 5 of its group is hot.
    scn = dataclasses.replace(BASE, fault="ep_straggler", fault_ranks=(6,), magnitude=1.6, token_counts=counts)
    found = _findings(scn, tmp_path)
    named = {r for f in found if f["kind"] in ("kernel_degraded", "rank_degraded", "compute_straggler")
             for r in f["ranks"]}  # type: ignore[attr-defined]
    assert named == {6}
    assert any("GroupProblemShape" in str(f["kernel"]) for f in found if f["ranks"] == [6])


@pytest.mark.slow
def test_a_hot_expert_in_a_stage_of_one_expert_group_is_no_slow_rank(tmp_path: Path) -> None:
    # The evaluation's scenario that found this (DP4 x PP2 x EP4, each stage one expert group of four, no
    # token counts, no phases): the hot expert's grouped GEMMs (2.3x an even share) hold most of its compute
    # time while its dense kernels run as its peers'. The rank comparison across kernels reads the dense ones.
    scn = Scenario.from_seed(2035106344, "token_imbalance", 256)
    assert (scn.dp, scn.pp, scn.ep, scn.token_counts, scn.annotate_phases) == (4, 2, 4, False, False)
    assert _findings(scn, tmp_path) == []



@pytest.mark.slow
def test_cold_experts_waiting_in_their_all_to_all_are_no_slow_link(tmp_path: Path) -> None:
    # The evaluation's scenario that found this (DP64 x TP2 x PP2, 64 expert pairs a stage, each pair's second
    # member hot, no token counts): the cold member waits in every combine all-to-all, so the collective's
    # upper mode holds cold members' calls only, and the hot members read there the tail of the lower mode.
    # 8 pairs whose hot member waited a few more times were named slow links.
    scn = Scenario.from_seed(1592634891, "token_imbalance", 256)
    assert (scn.dp, scn.tp, scn.pp, scn.ep, scn.token_counts) == (64, 2, 2, 2, False)
    assert _findings(scn, tmp_path) == []
