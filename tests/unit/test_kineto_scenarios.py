"""The independent Kineto scenario generator of the detection evaluation (load_tests/kineto_scenarios.py):
traces the importer reads, synchronous collectives, fault magnitudes, multimodal GEMMs, truth and scoring."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from argus.producers.kineto import find_traces, topology_from_pg_config
from argus.producers.kineto_parse import RankTrace, parse_rank
from load_tests.kineto_scenarios import (
    FAULT_CLASSES,
    GPUS_PER_NODE,
    LINK_FAULTS,
    RANK_KINDS,
    Scenario,
    Timeline,
    estimate_kernel_events,
    expected_findings,
    host_name,
    incident_ids,
    kernel_budget,
    score_findings,
    simulate,
    topology_flag,
    write_scenario,
)

pytestmark = pytest.mark.slow

SMALL = Scenario(seed=3, fault="healthy", dp=2, tp=2, pp=2, steps=8, microbatches=2, layers=1, hidden=4096,
                 tokens=4096, noise=0.05, name_style="sm90", nccl_stream_base=20)
TP_STREAM = SMALL.nccl_stream_base


def _parse_all(traces: Path) -> list[RankTrace]:
    return sorted((parse_rank(p) for p in find_traces(traces)), key=lambda t: t.rank)


def _rows(trace: RankTrace) -> Any:
    return np.concatenate(list(trace.rows(1 << 20)))


def _is_gemm(name: str) -> bool:
    return "gemm" in name.lower()


@pytest.mark.parametrize("variant", [
    {},
    {"compress": True, "absolute_ts": True, "annotate_phases": True, "nccl_annotations": True, "flows": True,
     "gpu_step_annotations": False, "extra_pgs": True, "first_step": 10, "name_style": "sm80_legacy"},
    {"moe": True, "ep": 2, "dp": 4, "tp": 1, "sequence_parallel": False, "schedule": "gpipe"},
])
def test_traces_parse_and_give_the_topology(tmp_path: Path, variant: dict[str, Any]) -> None:
    scn = dataclasses.replace(SMALL, **variant)
    tl = simulate(scn)
    traces = write_scenario(scn, tmp_path, tl)
    assert (tmp_path / "truth.json").is_file() and not list(traces.glob("truth*"))
    parsed = _parse_all(traces)
    try:
        assert [t.rank for t in parsed] == list(range(scn.world))
        counts = np.bincount(tl.rank, minlength=scn.world)
        for t in parsed:
            assert t.world_size == scn.world and not t.skipped and t.host and t.device
            assert t.gpu_index == t.rank % GPUS_PER_NODE and t.host == host_name(scn, t.rank)
            assert t.kernel_events == counts[t.rank]
            assert [s.step for s in t.steps] == [scn.first_step + i for i in range(scn.steps)]
            assert t.max_lag_ns == 0
        topo = topology_from_pg_config("j", scn.world, [g for t in parsed for g in t.pg_config])
        assert topo is not None
        assert (topo.dp_size, topo.tp_size, topo.pp_size, topo.ep_size) == (scn.dp, scn.tp, scn.pp, scn.ep)
        assert list(topo.pp_stage) == [r // scn.stage_size for r in range(scn.world)]
        if scn.annotate_phases:
            kinds = Counter(p.kind.value for p in parsed[0].phases)
            assert kinds["FORWARD"] == kinds["BACKWARD"] == 2 * scn.steps * scn.microbatches  # CPU + GPU mirror
            assert kinds["OPTIMIZER"] == 2 * scn.steps
        # Every kernel falls in a step.
        for t in parsed:
            from argus.producers.kineto_parse import assign_steps

            assert (assign_steps(t.intervals(gpu=True), _rows(t)["start"]) >= 0).all()
    finally:
        for t in parsed:
            t.close()


def test_collectives_of_a_group_end_together_and_early_members_wait(tmp_path: Path) -> None:
    scn = dataclasses.replace(SMALL, fault="compute_straggler", fault_ranks=(2,), magnitude=2.0, onset=0)
    parsed = _parse_all(write_scenario(scn, tmp_path))
    try:
        tp_rows = {}
        for t in parsed:
            rows = _rows(t)
            rows = rows[rows["stream"] == TP_STREAM]
            tp_rows[t.rank] = rows[np.argsort(rows["start"], kind="stable")]
        for group in ([0, 1], [2, 3], [4, 5], [6, 7]):
            ends = np.stack([tp_rows[r]["start"] + tp_rows[r]["dur"] for r in group])
            assert ends.shape[1] > 0
            assert (ends.max(axis=0) - ends.min(axis=0)).max() <= 1_000  # ns
        # Rank 2 is slow: its TP partner 3 arrives early and waits in the collective.
        assert np.median(tp_rows[3]["dur"]) > 3 * np.median(tp_rows[2]["dur"])
        # Healthy TP groups wait far less than the victim.
        assert np.median(tp_rows[0]["dur"]) < 0.5 * np.median(tp_rows[3]["dur"])
    finally:
        for t in parsed:
            t.close()


@pytest.mark.parametrize("magnitude", [1.3, 2.5])
def test_a_straggler_gemm_time_grows_by_the_magnitude(tmp_path: Path, magnitude: float) -> None:
    scn = dataclasses.replace(SMALL, fault="compute_straggler", fault_ranks=(5,), magnitude=magnitude, onset=3)
    parsed = _parse_all(write_scenario(scn, tmp_path))
    try:
        after: list[float] = []
        before: list[float] = []
        for t in parsed:
            rows = _rows(t)
            gemm = np.array([_is_gemm(n) for n in t.names])[rows["name"]]
            first_after = t.steps[3].start_ns
            after.append(float(rows["dur"][gemm & (rows["start"] >= first_after)].sum()))
            before.append(float(rows["dur"][gemm & (rows["start"] < first_after)].sum()))
        peers = [4, 6, 7]  # the same pipeline stage (the last one also runs the LM head)
        ratio_after = after[5] / np.median([after[r] for r in peers])
        ratio_before = before[5] / np.median([before[r] for r in peers])
        assert ratio_after == pytest.approx(magnitude, rel=0.08)
        assert ratio_before == pytest.approx(1.0, abs=0.08)
    finally:
        for t in parsed:
            t.close()


def test_one_gemm_name_has_several_duration_modes() -> None:
    tl = simulate(dataclasses.replace(SMALL, layers=2))
    fwd = next(i for i, n in enumerate(tl.names) if "tn_n_tilesize128x128x64" in n)
    d = np.sort(np.log(tl.dur[(tl.rank == 0) & (tl.name == fwd)]))
    modes = 1 + int((np.diff(d) > 0.2).sum())
    assert modes >= 2
    assert d[-1] - d[0] > np.log(2.5)  # QKV (3x) and out-projection (1x) share the name


def test_one_mode_slows_only_that_shape() -> None:
    scn = dataclasses.replace(SMALL, fault="one_mode", fault_ranks=(1,), fault_shape="gemm_fwd:proj", magnitude=1.5,
                              noise=0.03)
    tl = simulate(scn)
    fwd = next(i for i, n in enumerate(tl.names) if "tn_n_tilesize128x128x64" in n)

    def modes(rank: int) -> tuple[float, float]:
        d = np.sort(tl.dur[(tl.rank == rank) & (tl.name == fwd)])
        split = np.argmax(np.diff(np.log(d))) + 1
        return float(np.median(d[:split])), float(np.median(d[split:]))

    lo1, hi1 = modes(1)
    lo0, hi0 = modes(0)
    assert lo1 / lo0 == pytest.approx(1.5, rel=0.1)
    assert hi1 / hi0 == pytest.approx(1.0, abs=0.06)


def test_stage_slow_and_link_degraded_change_what_they_should() -> None:
    stage = simulate(dataclasses.replace(SMALL, fault="stage_slow", fault_stage=1, fault_ranks=(4, 5, 6, 7),
                                         magnitude=2.0))
    base = simulate(SMALL)
    bwd = (stage.phase == 2) & (stage.stream == 7)
    assert bwd.any() and np.array_equal(bwd, (base.phase == 2) & (base.stream == 7))
    for ranks, factor in ((range(4), 1.0), (range(4, 8), 2.0)):  # the same seed: the same noise
        sel = bwd & np.isin(stage.rank, list(ranks))
        assert stage.dur[sel].sum() / base.dur[sel].sum() == pytest.approx(factor, rel=1e-6)
    fwd = (stage.phase == 1) & (stage.stream == 7)
    assert stage.dur[fwd].sum() == pytest.approx(base.dur[fwd].sum(), rel=1e-9)
    link = simulate(dataclasses.replace(SMALL, fault="link_degraded", fault_group="tp", fault_ranks=(2, 3),
                                        magnitude=3.0))
    # The degraded TP group's last arrival still takes ~3x the transfer: its shortest collectives are longer.
    sel = link.stream == TP_STREAM
    short = {r: np.percentile(link.dur[sel & (link.rank == r)], 10) for r in range(4)}
    assert min(short[2], short[3]) > 2 * max(short[0], short[1])


def test_host_stall_spikes_wall_time_not_gpu_time() -> None:
    scn = dataclasses.replace(SMALL, fault="host_stall", stall_steps=(4,), magnitude=3.0)
    tl = simulate(scn)
    it = tl.iteration_us()
    others = np.delete(it, 4)
    assert it[4] / np.median(others) == pytest.approx(3.0, rel=0.15)
    end = tl.start + tl.dur
    gpu = [end[tl.step == n].max() - tl.start[tl.step == n].min() for n in range(scn.steps)]
    assert gpu[4] < 1.3 * np.median(np.delete(gpu, 4))


def test_short_trace_has_few_calls_per_name() -> None:
    for seed in range(4):
        scn = Scenario.from_seed(seed, "short_trace", 64)
        assert 1 <= scn.steps <= 3
        tl = simulate(scn)
        r = scn.fault_ranks[0]
        calls = Counter(tl.name[(tl.rank == r) & (tl.coll < 0)].tolist())
        assert max(calls.values()) <= 3
        gemm = np.array([_is_gemm(n) for n in tl.names])[tl.name]
        mine = tl.dur[gemm & (tl.rank == r)].sum()
        peer = [tl.dur[gemm & (tl.rank == q)].sum() for q in range(scn.world)
                if q != r and q // scn.stage_size == r // scn.stage_size]
        if peer:
            assert mine / np.median(peer) == pytest.approx(scn.magnitude, rel=0.15)


def test_draw_is_deterministic_and_sized() -> None:
    for fault in FAULT_CLASSES:
        for seed in range(6):
            scn = Scenario.from_seed(seed, fault, 64)
            assert scn == Scenario.from_seed(seed, fault, 64)
            assert scn.world <= 64 and scn.fault == fault
            assert estimate_kernel_events(scn) <= kernel_budget(scn.world)
            if fault not in ("short_trace",):
                assert 6 <= scn.steps <= 40
    big = Scenario.from_seed(1, "healthy", 512)
    assert estimate_kernel_events(big) <= kernel_budget(big.world)
    a, b = simulate(SMALL), simulate(SMALL)
    assert np.array_equal(a.start, b.start) and np.array_equal(a.name, b.name)


def test_truth_per_class() -> None:
    seen = set()
    for fault in FAULT_CLASSES:
        for seed in range(5):
            scn = Scenario.from_seed(seed, fault, 128)
            truth = expected_findings(scn)
            exp = truth["expected"]
            seen.add(fault)
            if fault in ("compute_straggler", "one_mode", "short_trace", "ep_straggler"):
                assert len(exp) == 1 and exp[0]["kinds"] == list(RANK_KINDS)
                assert exp[0]["ranks"] == list(scn.fault_ranks) and len(scn.fault_ranks) in (1, 2)
                assert fault != "ep_straggler" or (scn.moe and scn.ep >= 2)
            elif fault == "stage_slow":
                stage = scn.fault_stage
                assert exp[0]["kinds"] == ["pp_stage_slow"]
                assert exp[0]["ranks"] == list(range(stage * scn.stage_size, (stage + 1) * scn.stage_size))
                assert truth["tolerated"][0]["ranks"] == exp[0]["ranks"]
            elif fault in LINK_FAULTS:
                assert exp[0]["kinds"] == ["link_degraded"] and len(exp[0]["ranks"]) >= 2
                assert len(exp[0]["ranks"]) < scn.world
                if fault == "link_small_group":  # 2-4 members, or one of only two groups of its kind
                    size = len(scn.fault_ranks)
                    count = scn.world // size if scn.fault_group != "ep" else scn.world // scn.ep
                    assert scn.fault_group in ("tp", "dp", "ep") and (size <= 4 or count == 2)
                    assert not scn.pg_args
            elif fault == "job_regression":
                assert exp == [{"kinds": ["step_regression"], "ranks": [], "steps": None,
                                "onset": scn.first_step + scn.onset}]
                assert 5 <= scn.onset <= scn.steps - 5
            elif fault == "slow_host":
                host = scn.fault_ranks[0] // GPUS_PER_NODE
                assert exp[0]["kinds"] == ["node_degraded"] and exp[0]["hosts"] == [host_name(scn, scn.fault_ranks[0])]
                assert exp[0]["ranks"] == list(range(host * GPUS_PER_NODE, (host + 1) * GPUS_PER_NODE))
                assert truth["max_incidents"] == 1 and scn.dp * scn.tp >= 4 * GPUS_PER_NODE
                assert 1.15 <= scn.magnitude <= 1.5 and scn.all_compute
            elif fault == "host_stall":
                assert exp[0]["kinds"] == ["iteration_spike"]
                assert exp[0]["steps"] == [scn.first_step + s for s in scn.stall_steps] and exp[0]["steps"]
            else:
                assert exp == [] and not truth["optional"]
                if fault == "token_imbalance":
                    assert scn.moe and scn.ep >= 2 and len(scn.expert_skew) == scn.ep
                    assert max(scn.expert_skew) >= 1.3 and abs(sum(scn.expert_skew) - scn.ep) < 1e-9
    assert seen == set(FAULT_CLASSES)


def test_job_regression_under_five_percent_is_optional() -> None:
    scn = dataclasses.replace(SMALL, fault="job_regression", magnitude=1.1, onset=4, steps=10)
    entry = {"kinds": ["step_regression"], "ranks": [], "steps": None, "onset": scn.first_step + 4}
    small = expected_findings(scn, iteration_us=[100.0] * 4 + [104.0] * 6)
    assert small["expected"] == [] and small["optional"] == [entry]
    large = expected_findings(scn, iteration_us=[100.0] * 4 + [106.0] * 6)
    assert large["expected"] == [entry] and large["optional"] == []


def test_truth_json_holds_the_scenario(tmp_path: Path) -> None:
    scn = dataclasses.replace(SMALL, fault="job_regression", magnitude=1.3, onset=4, steps=10)
    write_scenario(scn, tmp_path)
    truth = json.loads((tmp_path / "truth.json").read_text())
    assert Scenario(**{k: tuple(v) if isinstance(v, list) else v for k, v in truth["scenario"].items()
                       if k != "world"}) == scn
    assert truth["expected"][0]["onset"] == 4 and len(truth["iteration_ms"]) == 10
    assert truth["kernel_events"] == estimate_kernel_events(scn)


def _f(kind: str, ranks: list[int], steps: list[int] | None = None) -> dict[str, Any]:
    return {"kind": kind, "ranks": ranks, "steps": steps or [], "level": "L3"}


def test_score_findings() -> None:
    straggler = {"expected": [{"kinds": list(RANK_KINDS), "ranks": [3, 9], "steps": None, "onset": 0}],
                 "optional": [{"kinds": ["step_regression"], "ranks": [], "steps": None, "onset": 12}],
                 "tolerated": [], "onset_tolerance": 2, "step_tolerance": 1}
    ok = score_findings(straggler, [_f("kernel_degraded", [3]), _f("compute_straggler", [9]),
                                    _f("step_regression", [], [13])])
    assert ok["exact"] and ok["tp"] == 2 and ok["fp"] == 0 and ok["fn"] == 0
    half = score_findings(straggler, [_f("kernel_degraded", [3])])
    assert not half["exact"] and half["missing"] and half["fn"] == 1
    extra = score_findings(straggler, [_f("kernel_degraded", [3, 9]), _f("link_degraded", [3, 9]),
                                       _f("step_regression", [], [20])])
    assert not extra["exact"] and len(extra["false"]) == 2 and extra["fp"] == 3
    other = score_findings(straggler, [_f("kernel_degraded", [3, 9, 4])])
    assert not other["exact"] and other["false"]
    stage = {"expected": [{"kinds": ["pp_stage_slow"], "ranks": [4, 5, 6, 7], "steps": None, "onset": 0}],
             "optional": [], "tolerated": [{"kinds": [*RANK_KINDS, "phase_straggler"], "ranks": [4, 5, 6, 7]}]}
    assert score_findings(stage, [_f("pp_stage_slow", [4, 5, 6, 7]), _f("kernel_degraded", [6])])["exact"]
    assert not score_findings(stage, [_f("pp_stage_slow", [4, 5, 6, 7]), _f("kernel_degraded", [3])])["exact"]
    stall = {"expected": [{"kinds": ["iteration_spike"], "ranks": [], "steps": [10, 20], "onset": None}],
             "optional": [], "tolerated": [], "step_tolerance": 1}
    assert score_findings(stall, [_f("iteration_spike", [], [11]), _f("iteration_spike", [], [20])])["exact"]
    assert not score_findings(stall, [_f("iteration_spike", [], [11])])["exact"]
    assert not score_findings(stall, [_f("iteration_spike", [], [10, 20]), _f("iteration_spike", [], [30])])["exact"]
    regression = {"expected": [{"kinds": ["step_regression"], "ranks": [], "steps": None, "onset": 15}],
                  "optional": [], "tolerated": [], "onset_tolerance": 2}
    assert score_findings(regression, [_f("step_regression", [], [17])])["exact"]
    assert not score_findings(regression, [_f("step_regression", [], [18])])["exact"]
    assert not score_findings(regression, [_f("step_regression", [], [15]), _f("compute_straggler", [2])])["exact"]
    healthy = {"expected": [], "optional": [], "tolerated": []}
    assert score_findings(healthy, [])["exact"]
    assert not score_findings(healthy, [_f("kernel_degraded", [1])])["exact"]


def test_timeline_select_orders_a_rank() -> None:
    tl: Timeline = simulate(SMALL)
    idx = tl.select(3)
    assert (np.diff(tl.start[idx]) >= 0).all() and (tl.rank[idx] == 3).all()


def test_a_slow_host_scores_exact_only_as_one_incident_naming_the_host() -> None:
    scn = Scenario.from_seed(3, "slow_host", 128)
    truth = expected_findings(scn)
    ranks, host = list(scn.fault_ranks), host_name(scn, scn.fault_ranks[0])

    def f(kind: str, rs: list[int], fid: str, incident: str, hosts: list[str] | None = None) -> dict[str, Any]:
        return {"kind": kind, "ranks": rs, "hosts": [host] if hosts is None else hosts, "finding_id": fid,
                "incident_id": incident, "steps": []}

    node = f("node_degraded", ranks, "n", "n")
    members = [f("rank_degraded", [r], f"r{r}", "n") for r in ranks]
    assert score_findings(truth, [node, *members])["exact"]
    alone = [f("rank_degraded", [r], f"r{r}", f"r{r}") for r in ranks]  # before incidents: 8 incidents
    res = score_findings(truth, [node, *alone])
    assert not res["exact"] and {"max_incidents": 1, "incidents": 9} in res["missing"]
    assert not score_findings(truth, [f("node_degraded", ranks, "n", "n", ["elsewhere"])])["exact"]
    assert not score_findings(truth, members)["exact"]  # no host named
    assert incident_ids([{"finding_id": "a"}, {"finding_id": "b", "incident_id": "a"}]) == {"a"}


def test_three_trace_variants_name_process_groups_or_not(tmp_path: Path) -> None:
    """Per-kernel process-group args (and pg_config), pg_config only, or neither: the importer then needs the
    topology given (topology_flag)."""
    seen = Counter(Scenario.from_seed(seed, "healthy", 16).pg_variant for seed in range(160))
    assert set(seen) == {"args", "pg_config", "none"} and min(seen.values()) >= 20  # 1/2, 1/4, 1/4
    for variant in ("args", "pg_config", "none"):
        scn = dataclasses.replace(SMALL, pg_args=variant == "args", pg_config=variant != "none")
        traces = write_scenario(scn, tmp_path / variant)
        parsed = _parse_all(traces)
        try:
            has_pg = [bool(t.pg_config) for t in parsed]
            named = [bool(t.stream_pgs) for t in parsed]
        finally:
            for t in parsed:
                t.close()
        assert all(has_pg) == (variant != "none") and any(has_pg) == all(has_pg)
        assert all(named) == (variant == "args") and any(named) == all(named)
        assert (topology_flag(scn) is None) == (variant != "none")
    assert topology_flag(dataclasses.replace(SMALL, pg_config=False)) == "dp=2,tp=2,pp=2"


def test_members_of_a_collective_end_within_the_jitter() -> None:
    scn = dataclasses.replace(SMALL, coend_jitter_us=3.0)
    tl = simulate(scn)
    tp = tl.stream == TP_STREAM
    # Per (step, call) the two members of a TP group end within 3 µs, not at one instant.
    ends = tl.start[tp] + tl.dur[tp]
    key = np.stack([tl.step[tp], tl.chunk[tp], tl.rank[tp] // scn.tp], axis=1)
    order = np.lexsort((tl.start[tp], key[:, 2], key[:, 1], key[:, 0]))
    a, b = ends[order][0::2], ends[order][1::2]
    assert np.abs(a - b).max() <= 3.0 and np.abs(a - b).max() > 0.0


MOE = dataclasses.replace(SMALL, moe=True, dp=4, tp=1, pp=1, ep=2, steps=6, microbatches=2, layers=1,
                          sequence_parallel=False, schedule="gpipe")


def _expert_rows(tl: Timeline) -> np.ndarray:
    return np.flatnonzero(tl.tokens >= 0)


def test_routing_conserves_tokens_in_an_expert_group_and_a_hot_expert_runs_longer() -> None:
    hot = dataclasses.replace(MOE, fault="token_imbalance", expert_skew=(1.6, 0.4))
    tl = simulate(hot)
    rows = _expert_rows(tl)
    assert rows.size
    # Per chunk the members of an expert group (ranks 0-1, 2-3) share its tokens: each of its two forward
    # grouped GEMMs (fc1, fc2) runs the group's tokens x top-k over its members.
    per: dict[tuple[int, int], list[int]] = {}
    for i in rows.tolist():
        per.setdefault((int(tl.chunk[i]), int(tl.rank[i]) // 2), []).append(int(tl.tokens[i]))
    expected = 2 * hot.tokens * hot.topk * hot.ep
    for toks in per.values():
        assert len(toks) == 4 and abs(sum(toks) - expected) <= 4
    # The hot position (0: ranks 0 and 2) gets ~4x its peer's tokens, and its grouped GEMMs run longer.
    tok_hot = tl.tokens[rows][np.isin(tl.rank[rows], [0, 2])].mean()
    tok_cold = tl.tokens[rows][np.isin(tl.rank[rows], [1, 3])].mean()
    assert 3.0 < tok_hot / tok_cold < 5.5
    dur = {r: tl.dur[rows][tl.rank[rows] == r].mean() for r in range(4)}
    assert min(dur[0], dur[2]) > 2.5 * max(dur[1], dur[3])


def test_token_counts_are_written_as_grouped_gemm_input_dims(tmp_path: Path) -> None:
    scn = dataclasses.replace(MOE, fault="token_imbalance", expert_skew=(1.5, 0.5), token_counts=True)
    tl = simulate(scn)
    traces = write_scenario(scn, tmp_path, tl)
    parsed = _parse_all(traces)
    try:
        for t in parsed:
            mine = _expert_rows(tl)[tl.rank[_expert_rows(tl)] == t.rank]
            want = {int(s): int(tl.tokens[mine][tl.step[mine] == s].sum()) for s in range(scn.steps)}
            assert {s.step - scn.first_step: s.expert_tokens for s in t.steps} == want
    finally:
        for t in parsed:
            t.close()
    plain_scn = dataclasses.replace(scn, token_counts=False)
    plain = write_scenario(plain_scn, tmp_path / "plain", simulate(plain_scn))
    parsed = _parse_all(plain)
    try:
        assert all(s.expert_tokens is None for t in parsed for s in t.steps)
    finally:
        for t in parsed:
            t.close()


def test_a_micro_batchs_backward_runs_its_experts_on_the_tokens_its_forward_routed() -> None:
    # Routing that wanders a lot per micro-batch, kernels without noise: each rank's backward grouped GEMMs
    # take the same multiple of its forward ones, since both run the tokens the forward routed.
    scn = dataclasses.replace(MOE, fault="token_imbalance", routing_noise=0.3, noise=1e-4, outlier_rate=0.0)
    tl = simulate(scn)
    grouped = np.isin(tl.name, [i for i, n in enumerate(tl.names) if "GroupProblemShape" in n]) & (tl.coll < 0)
    fwd, bwd = grouped & (tl.tokens >= 0), grouped & (tl.tokens < 0)
    ratio = np.array([tl.dur[bwd & (tl.rank == r)].sum() / tl.dur[fwd & (tl.rank == r)].sum()
                      for r in range(scn.world)])
    assert ratio.max() / ratio.min() < 1.01, ratio


def test_an_ep_straggler_slows_only_its_grouped_gemms() -> None:
    base = simulate(dataclasses.replace(MOE, fault="ep_straggler", fault_ranks=(3,), magnitude=1.0))
    slow = simulate(dataclasses.replace(MOE, fault="ep_straggler", fault_ranks=(3,), magnitude=2.0))
    compute = slow.coll < 0
    expert = np.zeros(slow.rank.size, dtype=bool)
    names = [i for i, n in enumerate(slow.names) if "GroupProblemShape" in n]
    expert[np.isin(slow.name, names)] = True
    ratio = slow.dur / base.dur
    assert np.allclose(ratio[compute & expert & (slow.rank == 3)], 2.0)
    assert np.allclose(ratio[compute & ~expert], 1.0)
    assert np.allclose(ratio[compute & expert & (slow.rank != 3)], 1.0)
