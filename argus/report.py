"""``argus report``: one self-contained HTML page of a job's diagnosis.

The page (:func:`build_report`) holds, top to bottom: a summary, the iteration time per step (median over
ranks, min-max band) with the L1 findings marked, the per-rank x phase heat map (L2), the per-rank x kernel W1
heat map (L3), the KDE clusters of the top suspect kernel against its peers, the findings table by impact and
the commands to drill down. Plots are plotly figures; plotly.js is inlined once, so the file works offline
(its Content-Security-Policy forbids every fetch). Jobs with many ranks show at most
:data:`~argus.report_data.MAX_RANK_ROWS` rank rows (suspects and an even sample), and the page says so.

Data comes from ClickHouse (``FINAL`` views of ``steps``, ``phases``, ``kernel_summaries``, ``topology``) through
:func:`argus.sinks.query_server.run_query` and the findings contract :func:`argus.sinks.findings_query.fetch_findings`;
the shaping is :mod:`argus.report_data`. Every string from the data is HTML-escaped.
"""

from __future__ import annotations

import html
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from argus import __version__
from argus.core.errors import ArgusError
from argus.core.kinds import FindingKind
from argus.core.settings import Settings
from argus.detectors.l3_kernels import is_collective
from argus.report_data import (
    MAX_KERNELS,
    MAX_PHASES,
    REFERENCE_SAMPLE,
    ClusterPlot,
    Components,
    HeatMap,
    KernelKey,
    Mark,
    RankSelection,
    cluster_plot,
    drill_commands,
    even_sample,
    format_duration,
    format_ranks,
    l1_marks,
    phase_heatmap,
    plot_text,
    select_ranks,
    step_bucket,
    suspect_ranks,
    top_suspect,
    w1_heatmap,
)
from argus.sinks.clickhouse import ClickHouseStore, QueryResult, sql_string
from argus.sinks.findings_query import fetch_findings
from argus.sinks.query_server import endpoint_healthy, run_query

__all__ = ["MAX_TABLE_ROWS", "Query", "ReportData", "build_report", "collect", "commands_html", "findings_table",
           "render_page"]

log = logging.getLogger(__name__)

#: Runs one SQL statement; defaults to :func:`argus.sinks.query_server.run_query` on the settings.
Query = Callable[[str], QueryResult]
#: Rows of the findings table at most (by impact); the page says how many more there are.
MAX_TABLE_ROWS = 200
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
        "font-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'")
_PLOT_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["lasso2d", "select2d"]}
_RED, _BLUE, _GREY = "#c0392b", "#2c6fbb", "#8a8f98"



def _ints(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values) or "-1"


@dataclass
class ReportData:
    """Everything the page draws, read from the store (see :func:`collect`)."""

    job_id: str
    database: str
    findings: list[dict[str, Any]]
    total_ranks: int
    selection: RankSelection
    hosts: dict[int, str] = field(default_factory=dict)
    steps: list[tuple[int, int, float, float, float, int]] = field(default_factory=list)
    step_bucket: int = 1
    n_steps: int = 0
    step_range: tuple[int, int] = (0, 0)
    start_ns: int = 0
    phases: HeatMap | None = None
    kernels: HeatMap | None = None
    clusters: ClusterPlot | None = None


def _collect_steps(run: Query, db: str, job: str, data: ReportData) -> None:
    n, first, last, start = run(f"SELECT uniqExact(step), min(step), max(step), min(start_ns) FROM `{db}`.steps FINAL "
                                f"WHERE job_id = {job}").rows[0]
    data.n_steps, data.step_range, data.start_ns = int(n), (int(first), int(last)), int(start)
    if not data.n_steps:
        return
    k = data.step_bucket = step_bucket(int(n), int(first), int(last))
    rows = run(f"""
        SELECT intDiv(step - {int(first)}, {k}) * {k} + {int(first)} AS s, uniqExact(rank),
               quantileExact(0.5)(wall_ns), min(wall_ns), max(wall_ns), argMax(rank, wall_ns)
        FROM `{db}`.steps FINAL WHERE job_id = {job} GROUP BY s ORDER BY s""").rows
    data.steps = [(int(s), int(r), float(m), float(lo), float(hi), int(sl)) for s, r, m, lo, hi, sl in rows]


def _collect_phases(run: Query, db: str, job: str, sel: RankSelection) -> HeatMap | None:
    per = (f"SELECT rank, step, name, any(kind) AS k, min(idx) AS i, sum(duration_ns) AS d FROM `{db}`.phases FINAL "
           f"WHERE job_id = {job} AND idx >= 0 {{extra}} GROUP BY rank, step, name")
    top = run(f"""
        SELECT name, any(k2), quantileExact(0.5)(m), min(i2) AS first_idx, sum(tot) AS total FROM (
          SELECT rank, name, any(k) AS k2, quantileExact(0.5)(d) AS m, sum(d) AS tot, min(i) AS i2
          FROM ({per.format(extra='')}) GROUP BY rank, name)
        GROUP BY name ORDER BY total DESC, name LIMIT {MAX_PHASES}""").rows
    if not top:
        return None
    phases = sorted(((str(n), str(k), float(m), int(i)) for n, k, m, i, _ in top), key=lambda p: (p[3], p[0]))
    names = ", ".join(sql_string(p[0]) for p in phases)
    cells = run(f"""
        SELECT rank, name, quantileExact(0.5)(d), count()
        FROM ({per.format(extra=f'AND rank IN ({_ints(sel.shown)}) AND name IN ({names})')})
        GROUP BY rank, name""").rows
    return phase_heatmap([(n, k, m) for n, k, m, _ in phases],
                         [(int(r), str(n), float(m), int(c)) for r, n, m, c in cells], sel)


def _collect_kernels(run: Query, db: str, job: str, data: ReportData, all_ranks: Sequence[int],
                     stages: Mapping[int, int] | None) -> None:
    top = run(f"""
        SELECT kernel, stream, sum(arraySum(cluster_sum_ns)) AS gpu FROM `{db}`.kernel_summaries FINAL
        WHERE job_id = {job} GROUP BY kernel, stream ORDER BY gpu DESC, kernel, stream LIMIT {MAX_KERNELS}""").rows
    kernels: list[tuple[KernelKey, float]] = [((str(k), int(s)), float(g)) for k, s, g in top]
    if not kernels:
        return
    l3 = next((f for f in data.findings if f["level"] == "L3" and f["kernel"] is not None), None)
    if l3 is not None and l3["stream"] is not None and (l3["kernel"], l3["stream"]) not in {k for k, _ in kernels}:
        extra = run(f"""
            SELECT sum(arraySum(cluster_sum_ns)) FROM `{db}`.kernel_summaries FINAL WHERE job_id = {job}
            AND kernel = {sql_string(l3['kernel'])} AND stream = {int(l3['stream'])}""").rows
        kernels.append(((l3["kernel"], int(l3["stream"])), float(extra[0][0] or 0)))
    groups = 1 + (max(stages.values()) if stages else 0)
    ranks = sorted(set(data.selection.shown) | set(even_sample(list(all_ranks), REFERENCE_SAMPLE * min(groups, 4))))
    keys = ", ".join(f"({sql_string(k)}, {s})" for (k, s), _ in kernels)
    rows = run(f"""
        SELECT kernel, stream, rank, groupArray(c), groupArray(p50), groupArray(p99) FROM (
          SELECT kernel, stream, rank, round(log(p50_) * 20) AS b, sum(c_) AS c,
                 exp(sum(c_ * log(p50_)) / sum(c_)) AS p50, exp(sum(c_ * log(greatest(p99_, p50_))) / sum(c_)) AS p99
          FROM `{db}`.kernel_summaries FINAL
          ARRAY JOIN cluster_count AS c_, cluster_p50_ns AS p50_, cluster_p99_ns AS p99_
          WHERE job_id = {job} AND (kernel, stream) IN ({keys}) AND rank IN ({_ints(ranks)}) AND c_ > 0 AND p50_ > 0
          GROUP BY kernel, stream, rank, b)
        GROUP BY kernel, stream, rank""").rows
    clusters: dict[KernelKey, dict[int, Components]] = {}
    for k, s, r, c, p50, p99 in rows:
        clusters.setdefault((str(k), int(s)), {})[int(r)] = (c, p50, p99)
    grouped = [key for key, _ in kernels if not is_collective(key[0])] if stages else []
    data.kernels, scores = w1_heatmap(kernels, clusters, data.selection, stages, grouped)
    pick = top_suspect(data.findings, scores)
    if pick is not None:
        key, suspects, why = pick
        if key not in clusters:  # an L3 finding without a stream: the kernel's busiest stream shown
            key = next((k for k, _ in kernels if k[0] == key[0]), key)
        if not suspects and key in scores and scores[key]:
            suspects = [max(scores[key], key=lambda r: abs(scores[key][r].relative))]
        data.clusters = cluster_plot(key, clusters.get(key, {}), suspects, why,
                                     stages if key in grouped else None)


def collect(settings: Settings, job_id: str, query: Query | None = None) -> ReportData:
    """Read what the report of ``job_id`` draws. Raises :class:`ArgusError` when nothing of the job is stored
    (and :class:`~argus.core.errors.SinkError`, one, when the store cannot be read)."""
    run: Query = query if query is not None else (lambda sql: run_query(settings, sql))
    db, job = settings.clickhouse_database, sql_string(job_id)
    findings = fetch_findings(settings, job_id, run)
    ranks = sorted(int(r) for (r,) in run(f"""
        SELECT DISTINCT rank FROM (
          SELECT rank FROM `{db}`.steps FINAL WHERE job_id = {job}
          UNION ALL SELECT rank FROM `{db}`.topology FINAL WHERE job_id = {job}
          UNION ALL SELECT rank FROM `{db}`.kernel_summaries FINAL WHERE job_id = {job})""").rows)
    if not ranks and not findings:
        raise ArgusError(f"no data for job {job_id!r} in database {db!r}: no steps, topology, kernel summaries or "
                         "findings are stored for it (is the job id right, and has the sink written it?)")
    topo = run(f"SELECT rank, host, pp_stage, pp_size FROM `{db}`.topology FINAL WHERE job_id = {job}").rows
    stages = {int(r): int(st) for r, _, st, pp in topo if int(pp) > 1} or None
    sel = select_ranks(ranks, suspect_ranks(findings))
    data = ReportData(job_id, db, findings, sel.total, sel, hosts={int(r): str(h) for r, h, _, _ in topo})
    _collect_steps(run, db, job, data)
    data.phases = _collect_phases(run, db, job, sel)
    _collect_kernels(run, db, job, data, ranks, stages)
    return data


def _iteration_figure(data: ReportData, marks: Sequence[Mark]) -> go.Figure:
    k, first = data.step_bucket, data.step_range[0]
    xs = [s for s, *_ in data.steps]
    med, lo, hi = ([row[i] / 1e6 for row in data.steps] for i in (2, 3, 4))
    by_step = {s: m for s, m in zip(xs, med, strict=True)}
    hover = [f"step {s}{f'-{s + k - 1}' if k > 1 else ''}: median {m:.4g} ms<br>min {a:.4g} ms, max {b:.4g} ms "
             f"(slowest: rank {sl})<br>{n} ranks" for (s, n, _, _, _, sl), m, a, b in zip(data.steps, med, lo, hi,
                                                                                            strict=True)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=lo, mode="lines", line={"width": 0}, hoverinfo="skip", showlegend=False))
    fig.add_trace(go.Scatter(x=xs, y=hi, mode="lines", line={"width": 0}, fill="tonexty",
                             fillcolor="rgba(44,111,187,0.18)", name="min-max over ranks", hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=xs, y=med, mode="lines+markers" if len(xs) <= 300 else "lines", name="median rank",
                             line={"color": _BLUE, "width": 2}, marker={"size": 4}, text=hover,
                             hovertemplate="%{text}<extra></extra>"))
    spikes = [m for m in marks if not m.line]
    if spikes:
        sx = [first + (m.step - first) // k * k for m in spikes]
        fig.add_trace(go.Scatter(x=sx, y=[by_step.get(x) for x in sx], mode="markers", name="L1 iteration spike",
                                 marker={"color": _RED, "size": 12, "symbol": "x"}, text=[m.label for m in spikes],
                                 hovertemplate="step %{x}: %{text}<extra></extra>"))
    for m in marks:
        if m.line:
            color = _RED if m.kind == FindingKind.STEP_REGRESSION.value else _GREY
            fig.add_vline(x=first + (m.step - first) // k * k, line={"color": color, "dash": "dash", "width": 2},
                          annotation={"text": m.label, "font": {"color": color}}, annotation_position="top left")
    for f in data.findings:
        ev = f["evidence"]
        if f["kind"] == "step_regression" and f["steps"] and "before_wall_ms" in ev and "after_wall_ms" in ev:
            onset = f["steps"][0]
            for a, b, y in ((ev.get("before_first_step", first), onset, ev["before_wall_ms"]),
                            (onset, ev.get("after_last_step", data.step_range[1]), ev["after_wall_ms"])):
                fig.add_shape(type="line", x0=a, x1=b, y0=y, y1=y, line={"color": _RED, "dash": "dot", "width": 1})
    fig.update_layout(height=380, margin={"l": 60, "r": 20, "t": 30, "b": 50}, template="plotly_white",
                      xaxis_title="step" + (f" (buckets of {k})" if k > 1 else ""), yaxis_title="iteration time (ms)",
                      legend={"orientation": "h", "y": 1.12, "x": 0}, hovermode="closest")
    return fig


def _unique(labels: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab} #{seen[lab]}")
    return out


def _heatmap_figure(hm: HeatMap) -> go.Figure:
    span = hm.zrange()
    fig = go.Figure(go.Heatmap(z=hm.z, x=_unique(hm.cols), y=hm.rows, text=hm.hover,
                               hovertemplate="%{text}<extra></extra>", colorscale="RdBu_r", zmid=0, zmin=-span,
                               zmax=span, xgap=1, ygap=1, hoverongaps=False,
                               colorbar={"title": {"text": plot_text(hm.colorbar), "side": "right"}}))
    longest = max((len(c) for c in hm.cols), default=10)
    fig.update_layout(height=max(320, 150 + 16 * len(hm.rows) + min(6 * longest, 260)), template="plotly_white",
                      margin={"l": 90, "r": 20, "t": 20, "b": 40},
                      xaxis={"type": "category", "tickangle": -40, "automargin": True, "side": "bottom"},
                      yaxis={"type": "category", "autorange": "reversed", "automargin": True})
    return fig


def _cluster_figure(cp: ClusterPlot, hosts: Mapping[int, str]) -> go.Figure:
    biggest = max((c for row in cp.rows for c in row.counts), default=1.0)
    fig = go.Figure()
    for suspect, color, name in ((True, _RED, "suspect rank"), (False, _GREY, "peer rank")):
        xs, ys, err, size, text = [], [], [], [], []
        for row in (r for r in cp.rows if r.suspect is suspect):
            total = sum(row.counts)
            label = ("\u2605 " if suspect else "") + f"rank {row.rank}"
            for c, p50, p99 in zip(row.counts, row.p50_ns, row.p99_ns, strict=True):
                xs.append(p50 / 1e3)
                ys.append(label)
                err.append((p99 - p50) / 1e3)
                size.append(6 + 22 * (c / biggest) ** 0.5)
                text.append(f"{label} ({plot_text(hosts.get(row.rank, '?'))})<br>p50 {p50 / 1e3:.4g} \u00b5s, "
                            f"p99 {p99 / 1e3:.4g} \u00b5s<br>{int(c)} launches ({100 * c / total:.0f} % of the rank's)")
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=name, text=text,
                                     hovertemplate="%{text}<extra></extra>",
                                     marker={"color": color, "size": size, "opacity": 0.75,
                                             "line": {"width": 1, "color": "white"}},
                                     error_x={"type": "data", "symmetric": False, "array": err,
                                              "arrayminus": [0.0] * len(err), "color": color, "thickness": 1.2}))
    fig.update_layout(height=max(300, 120 + 22 * len(cp.rows)), template="plotly_white",
                      margin={"l": 90, "r": 20, "t": 20, "b": 50},
                      xaxis={"type": "log", "dtick": 1, "minor": {"showgrid": True, "dtick": "D1"},
                             "title": {"text": "kernel duration (\u00b5s, log): cluster p50 \u2192 p99"}},
                      yaxis={"type": "category", "autorange": "reversed", "automargin": True},
                      legend={"orientation": "h", "y": 1.08, "x": 0})
    return fig


def _steps_text(steps: Sequence[int]) -> str:
    return "" if not steps else format_ranks(steps, limit=4).replace("job-wide", "")


def findings_table(findings: Sequence[Mapping[str, Any]], limit: int = MAX_TABLE_ROWS) -> str:
    """The findings (already by incident: each incident's lead, then its members, marked \u21b3) as an HTML
    table, every value escaped; at most ``limit`` rows."""
    if not findings:
        return '<p class="empty">No findings: the detectors saw nothing slow in this job.</p>'
    e = html.escape
    head = ("<tr><th>#</th><th>Level</th><th>Kind</th><th>Ranks</th><th>Hosts</th><th>Phase / kernel</th>"
            "<th>Steps</th><th>Score</th><th>GPU time lost / step</th><th>in all</th><th>Evidence</th></tr>")
    body = []
    sizes = Counter(str(f.get("incident_id") or f.get("finding_id") or i) for i, f in enumerate(findings))
    for i, f in enumerate(findings[:limit], 1):
        incident = str(f.get("incident_id") or f.get("finding_id") or i - 1)
        member = bool(f.get("finding_id")) and incident != f.get("finding_id")
        kind = ("\u21b3 " if member else "") + str(f.get("kind"))
        if not member and sizes[incident] > 1:
            kind += f" (+{sizes[incident] - 1} findings)"
        where = " / ".join(str(v) for v in (f.get("phase"), f.get("kernel")) if v)
        if f.get("stream") is not None:
            where += f" (stream {f['stream']})"
        ev = json.dumps(f.get("evidence") or {}, indent=1, sort_keys=True, default=str)
        ev = ev if len(ev) <= 4000 else ev[:4000] + "\n\u2026"
        body.append(
            f'<tr class="lvl-{e(str(f.get("level")))}{" member" if member else ""}"><td>{i}</td>'
            f'<td>{e(str(f.get("level")))}</td>'
            f"<td>{e(kind)}</td><td>{e(format_ranks(f.get('ranks') or ()))}</td>"
            f"<td>{e(', '.join(f.get('hosts') or ()) or '-')}</td>"
            f'<td class="name" title="{e(where)}">{e(where)}</td><td>{e(_steps_text(f.get("steps") or ()))}</td>'
            f"<td>{float(f.get('score') or 0):.3g}</td><td>{e(format_duration(f.get('impact_ns_per_step') or 0))}</td>"
            f"<td>{e(format_duration(f.get('impact_ns') or 0))}</td>"
            f"<td><details><summary>show</summary><pre>{e(ev)}</pre></details></td></tr>")
    more = (f'<p class="note">{len(findings) - limit} more findings (smaller impact) are not shown: '
            "<code>argus findings --json</code> has them all.</p>" if len(findings) > limit else "")
    return f'<table class="findings"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>{more}'


def commands_html(commands: Sequence[tuple[str, str]]) -> str:
    """The drill-down commands as escaped ``<pre>`` blocks with their titles."""
    return "".join(f"<h3>{html.escape(what)}</h3><pre class=\"cmd\">{html.escape(cmd)}</pre>" for what, cmd in commands)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 32px}header h1{margin:0 0 4px;font-size:22px}
header .sub{color:#b9c0cc;font-size:13px}nav{padding:8px 32px;background:#fff;border-bottom:1px solid #dde1e6}
nav a{margin-right:18px;color:#2c6fbb;text-decoration:none}main{max-width:1400px;margin:0 auto;padding:16px 32px}
section{background:#fff;border:1px solid #dde1e6;border-radius:8px;margin:16px 0;padding:14px 18px}
section h2{margin:0 0 6px;font-size:17px}.note{color:#5b6472;font-size:12.5px;margin:4px 0 8px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-top:12px}.card{background:#2a3242;border-radius:6px;
padding:8px 14px;min-width:120px}.card b{display:block;font-size:19px}.card span{color:#b9c0cc;font-size:12px}
.top{margin-top:12px;color:#ffd9a8}.empty{color:#5b6472;font-style:italic}
table.findings{border-collapse:collapse;width:100%;font-size:13px}table.findings th{text-align:left;
background:#eef0f3;padding:6px}table.findings td{border-top:1px solid #e6e8eb;padding:5px 6px;vertical-align:top}
td.name{max-width:380px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;font-family:ui-monospace,monospace}
tr.lvl-L1 td:nth-child(2){color:#7d3cbf;font-weight:600}tr.lvl-L2 td:nth-child(2){color:#c0392b;font-weight:600}
tr.lvl-L3 td:nth-child(2){color:#b9770e;font-weight:600}details pre{max-height:260px;overflow:auto;font-size:11.5px}
tr.member td{background:#fafbfc;color:#555}tr.member td:nth-child(3){padding-left:18px}
pre.cmd{background:#1d2330;color:#e8ecf2;padding:8px 12px;border-radius:6px;overflow-x:auto;white-space:pre-wrap;
word-break:break-all}header code{background:#2a3242;color:#ffd9a8;padding:1px 6px}
h3{font-size:13px;margin:12px 0 4px}code{background:#eef0f3;padding:1px 4px;border-radius:3px}
footer{color:#8a8f98;font-size:12px;text-align:center;padding:16px}
"""


def _section(anchor: str, title: str, note: str, body: str) -> str:
    return (f'<section id="{anchor}"><h2>{html.escape(title)}</h2><p class="note">{html.escape(note)}</p>'
            f"{body}</section>")


def _fig_html(fig: go.Figure, div_id: str) -> str:
    return str(pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOT_CONFIG,
                           default_height=f"{fig.layout.height}px", default_width="100%"))


def _summary(data: ReportData) -> str:
    e = html.escape
    levels = {lv: sum(f["level"] == lv for f in data.findings) for lv in ("L1", "L2", "L3")}
    cards = [(str(data.total_ranks), "ranks"), (str(data.n_steps), "steps"),
             (f"{levels['L1']} / {levels['L2']} / {levels['L3']}", "findings L1 / L2 / L3")]
    if data.steps:
        cards.append((format_duration(sorted(m for _, _, m, *_ in data.steps)[len(data.steps) // 2]),
                      "median iteration"))
    out = '<div class="cards">' + "".join(f"<div class=\"card\"><b>{e(v)}</b><span>{e(t)}</span></div>"
                                          for v, t in cards) + "</div>"
    if data.findings:
        f = data.findings[0]
        where = ", ".join(f"{k} {v}" for k, v in (("phase", f["phase"]), ("kernel", f["kernel"])) if v)
        hosts = f" on host{'s' if len(f.get('hosts') or ()) > 1 else ''} {', '.join(f['hosts'])}" \
            if f.get("hosts") else ""
        lead = f.get("incident_id") or f.get("finding_id")
        folded = sum(1 for g in data.findings if lead and (g.get("incident_id") or g.get("finding_id")) == lead) - 1
        also = f" It folds {folded} more finding{'s' if folded != 1 else ''} of the same cause." if folded > 0 else ""
        out += (f'<div class="top">Top incident: {e(f["level"])} {e(f["kind"])}{e(hosts)} on ranks '
                f'{e(format_ranks(f["ranks"]))}'
                f"{e(', ' + where) if where else ''}: {e(format_duration(f['impact_ns_per_step']))} of GPU time lost "
                f"per step, {e(format_duration(f['impact_ns']))} in all.{e(also)}</div>")
    return out


def render_page(data: ReportData) -> tuple[str, list[str]]:
    """The HTML page of ``data`` and the names of the plots it draws."""
    e = html.escape
    plots: list[str] = []
    sections = []
    if data.steps:
        plots.append("iteration_time")
        marks = l1_marks(data.findings)
        body = _fig_html(_iteration_figure(data, marks), "plot-iteration")
        buckets = f" (buckets of {data.step_bucket} steps)" if data.step_bucket > 1 else ""
        note = (f"Median over ranks per step{buckets}"
                f", with the min-max band; {len(marks)} L1 mark(s): spikes as crosses, regression onsets and stalls as "
                "dashed lines (dotted: the medians before and after).")
    else:
        body, note = '<p class="empty">No steps stored for this job.</p>', ""
    sections.append(_section("iteration", "Iteration time (L1)", note, body))
    for anchor, title, hm, name in (("phases", "Per-rank phase times (L2)", data.phases, "phase_heatmap"),
                                    ("kernels", "Per-rank kernel W1 (L3)", data.kernels, "kernel_w1_heatmap")):
        if hm is not None and hm.cells:
            plots.append(name)
            sections.append(_section(anchor, title, hm.note, _fig_html(_heatmap_figure(hm), f"plot-{anchor}")))
        else:
            sections.append(_section(anchor, title, "", '<p class="empty">No data stored for this job.</p>'))
    cp = data.clusters
    if cp is not None:
        plots.append("kernel_clusters")
        title = f"KDE clusters of {cp.kernel[0]} (stream {cp.kernel[1]})"
        body = (f'<p class="note">Chosen as the {e(cp.why)}: <code title="{e(cp.kernel[0])}">'
                f"{e(cp.kernel[0])}</code></p>" + _fig_html(_cluster_figure(cp, data.hosts), "plot-clusters"))
        sections.append(_section("clusters", title if len(title) <= 100 else title[:99] + "\u2026", cp.note, body))
    else:
        sections.append(_section("clusters", "KDE clusters of the top suspect kernel", "",
                                 '<p class="empty">No kernel summaries stored for this job.</p>'))
    n_incidents = len({f.get("incident_id") or f.get("finding_id") or i for i, f in enumerate(data.findings)})
    sections.append(_section("findings", f"Findings by incident ({n_incidents} incidents, {len(data.findings)} "
                                         "findings)",
                             "Incidents by the GPU time the job lost to them (impact_ns), each its lead finding "
                             "then the findings of the same cause (\u21b3, docs/incidents.md).",
                             findings_table(data.findings)))
    cmds = drill_commands(data.job_id, data.database, data.findings, *data.step_range,
                          {s: sl for s, _, _, _, _, sl in data.steps})
    sections.append(_section("drill", "Drill down", "Run these where argus runs (the stack or a sink is up).",
                             commands_html(cmds)))
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (("iteration", "Iteration time"), ("phases", "Phases"),
                                                          ("kernels", "Kernels"), ("clusters", "Clusters"),
                                                          ("findings", "Findings"), ("drill", "Drill down")))
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    started = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data.start_ns / 1e9)) if data.start_ns else "?")
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>argus report: {e(data.job_id)}</title><style>{_CSS}</style>"
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>"
        f"<script>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>argus report: job <code>{e(data.job_id)}</code></h1>"
        f'<div class="sub">database {e(data.database)} \u00b7 job started {started} \u00b7 generated {when} by argus '
        f"{e(__version__)}</div>{_summary(data)}</header><nav>{nav}</nav><main>{''.join(sections)}</main>"
        "<footer>Self-contained: plotly.js is inlined and the page fetches nothing.</footer></body></html>\n")
    return page, plots


def build_report(settings: Settings, job_id: str, out: Path, query: Query | None = None) -> dict[str, Any]:
    """Write the HTML report of ``job_id`` to ``out`` (atomically; parent folders created) and return what it
    drew: ``path``, ``bytes``, ``plots`` (names), ``findings``, ``ranks`` and ``ranks_shown``, ``steps``,
    ``phases`` and ``kernels`` (columns of the heat maps) and ``top_kernel``.

    ``query`` runs one SQL statement (default :func:`argus.sinks.query_server.run_query` on ``settings``).

    Raises:
        ArgusError: nothing of the job is stored, the store cannot be read, or ``out`` cannot be written.
    """
    started = time.monotonic()
    if query is None and settings.chdb_path is not None and endpoint_healthy(settings) is None:
        # No sink owns the embedded store: open it once for all the report's queries (run_query would reopen it).
        store = ClickHouseStore(settings.clickhouse)
        try:
            store.ensure_schema()
            data = collect(settings, job_id, store.query)
        finally:
            store.close()
    else:
        data = collect(settings, job_id, query)
    page, plots = render_page(data)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ArgusError(f"cannot write the report to {out}: {exc}") from exc
    size = out.stat().st_size
    log.info("report of job %s: %s (%d bytes, plots %s) in %.1f s", job_id, out, size, plots,
             time.monotonic() - started)
    return {"job": job_id, "path": str(out), "bytes": size, "plots": plots, "findings": len(data.findings),
            "ranks": data.total_ranks, "ranks_shown": len(data.selection.shown), "steps": data.n_steps,
            "phases": len(data.phases.cols) if data.phases else 0,
            "kernels": len(data.kernels.cols) if data.kernels else 0,
            "top_kernel": data.clusters.kernel[0] if data.clusters else None}
