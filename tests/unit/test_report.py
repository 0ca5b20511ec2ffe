"""``argus report``'s pure parts: rank capping, the heat-map matrices, W1 scores, marks, commands and escaping."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.report import ReportData, build_report, commands_html, findings_table, render_page
from argus.report_data import (
    MAX_RANK_ROWS,
    MAX_SUSPECT_ROWS,
    cluster_plot,
    drill_commands,
    even_sample,
    format_duration,
    format_ranks,
    kernel_labels,
    l1_marks,
    phase_heatmap,
    select_ranks,
    short_label,
    step_bucket,
    suspect_ranks,
    top_suspect,
    w1_heatmap,
    w1_scores,
)
from argus.sinks.clickhouse import QueryResult

EVIL = '<img src=x onerror="alert(1)">&'


def finding(level: str, kind: str, ranks: list[int], *, steps: list[int] | None = None, kernel: str | None = None,
            stream: int | None = None, phase: str | None = None, impact: float = 1e9,
            **evidence: Any) -> dict[str, Any]:
    return {"job": "j", "level": level, "kind": kind, "ranks": ranks, "phase": phase, "kernel": kernel,
            "stream": stream, "steps": steps or [], "score": 2.0, "evidence": evidence, "time_ns": 0,
            "impact_ns_per_step": impact / 10, "impact_ns": impact, "detector_version": "t"}


def clusters(scale: float = 1.0, n: int = 100) -> tuple[list[float], list[float], list[float]]:
    return [float(n), float(n // 4)], [100_000 * scale, 400_000 * scale], [120_000 * scale, 480_000 * scale]


def test_formatting_and_labels() -> None:
    assert format_ranks([7, 4, 5, 6, 12]) == "4\u20137, 12"
    assert format_ranks([]) == "job-wide"
    assert format_ranks(range(0, 100, 2), limit=3) == "0, 2, 4 (+47 more)"
    assert [format_duration(v) for v in (850e3, 999.9e3, 12.3e6, 63.1e9, 9000e9)] == [
        "850 \u00b5s", "1.00 ms", "12.3 ms", "63.1 s", "2.50 h"]
    name = "void at::native::(anonymous namespace)::vectorized_elementwise_kernel<4, FillFunctor<float>>"
    label = short_label(name, 40)
    assert "\u2026" in label and label.startswith("void at::") and label.endswith("&lt;float&gt;&gt;")
    assert short_label(EVIL) == "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;"
    assert kernel_labels([("k", 1), ("k", 2), ("g", 1)]) == ["k [s1]", "k [s2]", "g"]
    assert even_sample(list(range(10)), 3) == [0, 4, 9] and even_sample([1, 2], 5) == [1, 2]
    assert step_bucket(30, 0, 29) == 1 and step_bucket(100_000, 0, 99_999, max_points=5000) == 20


def test_select_ranks_small_job_shows_all() -> None:
    sel = select_ranks(range(8), [5])
    assert sel.shown == list(range(8)) and sel.suspects == {5} and sel.total == 8
    assert sel.label(5) == "\u2605 rank 5" and sel.label(4) == "rank 4" and "All 8 ranks" in sel.note


def test_select_ranks_caps_a_big_job() -> None:
    suspects = [1500, 7, 900, *range(2000, 2100)]  # more suspects than rows for them
    sel = select_ranks(range(4096), suspects)
    assert len(sel.shown) == MAX_RANK_ROWS and sel.shown == sorted(sel.shown)
    assert {1500, 7, 900} <= set(sel.shown) and len(sel.suspects) == MAX_SUSPECT_ROWS
    assert sel.suspects == set(suspects[:MAX_SUSPECT_ROWS])  # the highest-impact findings' ranks first
    assert 0 in sel.shown and 4095 in sel.shown  # the even sample spans the job
    assert sel.note.startswith(f"{MAX_RANK_ROWS} of 4096 ranks") and "71 more suspects not shown" in sel.note


def test_suspect_ranks_in_impact_order() -> None:
    fs = [finding("L2", "compute_straggler", [5]), finding("L1", "step_regression", []),
          finding("L3", "link_degraded", [4, 5, 6, 7])]
    assert suspect_ranks(fs) == [5, 4, 6, 7]


def test_phase_heatmap_matrix() -> None:
    sel = select_ranks(range(4), [2])
    phases = [("forward", "FORWARD", 10e6), (EVIL, "OTHER", 2e6), ("backward", "BACKWARD", 20e6)]
    cells = [(r, "forward", 10e6, 30) for r in range(4)] + [(2, "backward", 30e6, 30), (1, "backward", 20e6, 30),
                                                            (9, "forward", 99e6, 30), (0, "nope", 1e6, 1)]
    hm = phase_heatmap(phases, cells, sel)
    assert hm.rows == ["rank 0", "rank 1", "\u2605 rank 2", "rank 3"] and len(hm.cols) == 3
    assert hm.z[2] == [0.0, None, pytest.approx(50.0)] and hm.z[1][2] == 0.0 and hm.z[0][2] is None
    assert hm.cells == 6 and hm.zrange() == pytest.approx(50.0)
    assert EVIL not in hm.cols[1] and "&lt;img" in hm.cols[1] and "&lt;img" in hm.hover[0][1]
    assert "+50.0 %" in hm.hover[2][2]


def test_w1_scores_flag_the_slow_rank() -> None:
    per_rank = {r: clusters(1.0 + 0.002 * r) for r in range(8)}
    per_rank[5] = clusters(2.0)
    per_rank[3] = clusters(0.5)
    scores = w1_scores(per_rank, range(8))
    assert set(scores) == set(range(8))
    assert scores[5].relative == pytest.approx(1.0, rel=0.1)  # twice as long: +100 % of the peers' mean
    assert scores[3].relative == pytest.approx(-0.5, rel=0.1)  # faster: negative
    assert all(abs(scores[r].relative) < 0.05 for r in (0, 1, 2, 4, 6, 7))
    assert scores[5].w1_ns == pytest.approx(scores[5].relative * 160_000, rel=0.1)


def test_w1_scores_within_groups_and_bad_clusters() -> None:
    # Stage 1 runs the kernel 3x longer: against its own stage nobody is slow; rank 9 has only junk clusters.
    per_rank = {r: clusters(1.0 if r < 4 else 3.0) for r in range(8)}
    per_rank[9] = ([0.0], [0.0], [0.0])
    stages = {r: r // 4 for r in range(10)}
    grouped = w1_scores(per_rank, range(10), stages)
    assert set(grouped) == set(range(8)) and all(abs(c.relative) < 1e-6 for c in grouped.values())
    pooled = w1_scores(per_rank, range(8))
    assert min(abs(pooled[r].relative) for r in range(8)) > 0.3
    assert w1_scores({0: clusters()}, [0])[0].w1_ns == pytest.approx(0.0, abs=1e-6)


def test_w1_heatmap_and_top_suspect() -> None:
    sel = select_ranks(range(6), [4])
    per_a = {r: clusters(3.0 if r == 4 else 1.0) for r in range(6)}
    per_b = {r: clusters(1.0) for r in range(6) if r != 2}
    kernels = [(("gemm", 7), 5e9), ((EVIL, 9), 1e9)]
    hm, scores = w1_heatmap(kernels, {("gemm", 7): per_a, (EVIL, 9): per_b}, sel)
    assert len(hm.rows) == 6 and len(hm.cols) == 2 and "&lt;img" in hm.cols[1]
    assert hm.z[4][0] == pytest.approx(200.0, rel=0.1) and hm.z[2][1] is None and hm.cells == 11
    assert all(EVIL not in h for row in hm.hover for h in row)
    # No L3 finding: the largest W1; an L3 finding: its kernel and ranks, whatever the W1 says.
    assert top_suspect([], scores) == (("gemm", 7), [4], "largest W1 to its peers (no L3 finding)")
    l3 = finding("L3", "kernel_degraded", [1], kernel=EVIL, stream=9)
    key, ranks, why = top_suspect([finding("L2", "compute_straggler", [4]), l3], scores) or (None, None, "")
    assert key == (EVIL, 9) and ranks == [1] and "kernel_degraded" in why
    assert top_suspect([], {}) is None


def test_cluster_plot_suspects_and_peers() -> None:
    per_rank = {r: clusters(2.0 if r == 40 else 1.0) for r in range(100)}
    cp = cluster_plot(("gemm", 7), per_rank, [40, 999], "why")
    assert cp is not None and [r.rank for r in cp.rows if r.suspect] == [40]
    peers = [r.rank for r in cp.rows if not r.suspect]
    assert len(peers) == 24 and 40 not in peers and peers == sorted(peers)
    assert cp.rows[0].p50_ns == [200_000.0, 800_000.0] and "1 suspect rank(s) against 24 of 99 peers" in cp.note
    staged = cluster_plot(("gemm", 7), per_rank, [40], "why", groups={r: r // 50 for r in range(100)})
    assert staged is not None and all(r.rank < 50 for r in staged.rows)
    assert cluster_plot(("gemm", 7), per_rank, [999], "why") is None


def test_l1_marks() -> None:
    marks = l1_marks([finding("L1", "iteration_spike", [], steps=[12, 13], spike_ratio=3.04),
                      finding("L1", "step_regression", [], steps=[15]),
                      finding("L2", "compute_straggler", [5], steps=[15]),
                      finding("L1", "job_stalled", [], steps=[20])])
    assert [(m.step, m.kind, m.line) for m in marks] == [(12, "iteration_spike", False), (13, "iteration_spike", False),
                                                         (15, "step_regression", True), (20, "job_stalled", True)]
    assert marks[0].label == "spike x3.04" and marks[2].label == "regression x2.00"


def test_drill_commands_quote_untrusted_names() -> None:
    job = "it's; rm -rf /"
    fs = [finding("L1", "step_regression", [], steps=[15]),
          finding("L3", "kernel_degraded", [5], steps=[], kernel="k'$(x)`", stream=1),
          finding("L2", "compute_straggler", [5], steps=[15])]
    cmds = drill_commands(job, "argus", fs, 0, 29, {15: 3})
    traces = [shlex.split(c) for _, c in cmds if c.startswith("argus export-trace")]
    # Job-wide: the top suspect (5); the L3 finding has no steps: the middle of the job; the L2 one repeats the first.
    assert [t[t.index("--rank") + 1] for t in traces] == ["5", "5"]
    spans = [(t[t.index("--from-step") + 1], t[t.index("--to-step") + 1]) for t in traces]
    assert spans == [("13", "17"), ("12", "16")]
    assert all(t[t.index("--job") + 1] == job for t in traces)
    sql = [shlex.split(c) for _, c in cmds if c.startswith("argus sql")]
    assert len(sql) == 2 and all(len(s) == 3 for s in sql)
    assert "job_id = 'it\\'s; rm -rf /'" in sql[0][2] and "kernel = 'k\\'$(x)`'" in sql[1][2]
    assert shlex.split(next(c for _, c in cmds if "findings" in c)) == ["argus", "findings", "--job", job, "--json"]
    plain = drill_commands("j1", "argus", [fs[2]], 0, 29, {})
    assert any(c.startswith('argus sql "SELECT') for _, c in plain)  # double quotes where the shell allows


def test_tables_escape_data() -> None:
    fs = [finding("L3", "kernel_degraded", [5], kernel=EVIL, stream=2, note=EVIL)]
    table = findings_table(fs)
    assert EVIL not in table and "&lt;img src=x" in table and table.count("<tr") == 2
    assert "No findings" in findings_table([])
    many = findings_table([fs[0]] * 5, limit=2)
    assert many.count("<tr") == 3 and "3 more findings" in many
    cmds = commands_html([(EVIL, f"argus sql {EVIL}")])
    assert EVIL not in cmds and cmds.count("&lt;img") == 2


def test_render_page_escapes_and_inlines_plotly_once() -> None:
    sel = select_ranks(range(4), [2])
    fs = [finding("L3", "kernel_degraded", [2], kernel=EVIL, stream=1, steps=[3]),
          finding("L1", "iteration_spike", [], steps=[3], spike_ratio=2.5)]
    per_rank = {r: clusters(2.0 if r == 2 else 1.0) for r in range(4)}
    kernels, scores = w1_heatmap([((EVIL, 1), 1e9)], {(EVIL, 1): per_rank}, sel)
    data = ReportData(
        job_id=EVIL, database="argus", findings=fs, total_ranks=4, selection=sel, hosts={2: EVIL},
        steps=[(s, 4, 100e6 * (2.5 if s == 3 else 1), 90e6, 260e6, 2) for s in range(8)], n_steps=8,
        step_range=(0, 7), start_ns=1_767_225_600_000_000_000,
        phases=phase_heatmap([(EVIL, "OTHER", 1e6)], [(r, EVIL, 1e6 * (1 + r), 8) for r in range(4)], sel),
        kernels=kernels, clusters=cluster_plot((EVIL, 1), per_rank, [2], "highest-impact L3 finding"))
    page, plots = render_page(data)
    assert plots == ["iteration_time", "phase_heatmap", "kernel_w1_heatmap", "kernel_clusters"]
    assert EVIL not in page and "onerror=\"alert" not in page
    assert page.count("plotly.js v") == 1 and "<script src" not in page and "Content-Security-Policy" in page
    assert top_suspect(fs, scores) is not None
    empty, none = render_page(ReportData("j", "argus", [], 0, select_ranks([], [])))
    assert none == [] and "No steps stored" in empty and "No findings" in empty


def test_no_data_is_an_argus_error(tmp_path: Path) -> None:
    asked: list[str] = []

    def query(sql: str) -> QueryResult:
        asked.append(sql)
        return QueryResult(("x",), [])

    settings = Settings.load(env={}, home=tmp_path)
    with pytest.raises(ArgusError, match="no data for job 'ghost'"):
        build_report(settings, "ghost", tmp_path / "out.html", query=query)
    assert not (tmp_path / "out.html").exists() and all("FINAL" in q for q in asked)


def test_findings_table_marks_incidents_and_their_members() -> None:
    lead = {**finding("L3", "node_degraded", list(range(8, 16))), "finding_id": "n", "incident_id": "n",
            "hosts": ["node0001"]}
    members = [{**finding("L3", "rank_degraded", [r], impact=5e8), "finding_id": f"r{r}", "incident_id": "n",
                "hosts": ["node0001"]} for r in (8, 9)]
    alone = {**finding("L3", "kernel_degraded", [40], kernel="k", stream=7), "finding_id": "k", "incident_id": "k",
             "hosts": ["node0005"]}
    table = findings_table([lead, *members, alone])
    assert "node_degraded (+2 findings)" in table and table.count('class="lvl-L3 member"') == 2
    assert table.count("\u21b3 rank_degraded") == 2 and "node0001" in table and "node0005" in table
    assert "kernel_degraded (+" not in table
    old = findings_table([finding("L3", "kernel_degraded", [5], kernel="k", stream=7)])  # before schema v4
    assert "member" not in old and "(+" not in old
