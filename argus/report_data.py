"""Pure data shaping of ``argus report`` (:mod:`argus.report`): no I/O, no plotting.

The report reads aggregated rows from ClickHouse and this module turns them into what the page draws:
which ranks get a row when a job has thousands (:func:`select_ranks`), the per-rank x phase matrix (L2,
:func:`phase_heatmap`), the per-rank x kernel W1 matrix (L3, :func:`w1_heatmap`, the project's mixture math of
:mod:`argus.detectors.mixture`), the KDE clusters of the top suspect kernel (:func:`cluster_plot`), the L1 marks
on the iteration-time series (:func:`l1_marks`) and the drill-down commands (:func:`drill_commands`).

Every label and hover text meant for a plot is HTML-escaped here (:func:`plot_text`): plotly renders a
subset of HTML in text, and kernel and phase names are untrusted input.
"""

from __future__ import annotations

import html
import logging
import math
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.mixture import MixtureBatch, geometric_grid, mixture_cdf
from argus.sinks.clickhouse import sql_string

__all__ = [
    "LABEL_CHARS",
    "MAX_KERNELS",
    "MAX_PHASES",
    "MAX_RANK_ROWS",
    "MAX_STEP_POINTS",
    "MAX_SUSPECT_ROWS",
    "REFERENCE_SAMPLE",
    "ClusterPlot",
    "ClusterRow",
    "Components",
    "HeatMap",
    "KernelKey",
    "Mark",
    "RankSelection",
    "W1Cell",
    "cluster_plot",
    "drill_commands",
    "even_sample",
    "format_duration",
    "format_ranks",
    "kernel_labels",
    "l1_marks",
    "phase_heatmap",
    "plot_text",
    "select_ranks",
    "short_label",
    "step_bucket",
    "suspect_ranks",
    "top_suspect",
    "w1_heatmap",
    "w1_scores",
]

log = logging.getLogger(__name__)

#: Rank rows of a heat map at most: the suspects named by findings, then an even sample of the others.
MAX_RANK_ROWS = 64
#: Of those, rows given to suspects at most (the highest-impact findings' ranks first).
MAX_SUSPECT_ROWS = 32
#: Kernel columns of the W1 heat map: the job's top kernels by GPU time (plus the top suspect kernel).
MAX_KERNELS = 30
#: Phase columns of the phase heat map: the phases with the most time.
MAX_PHASES = 40
#: Ranks whose pointwise-median CDF is a kernel's reference, at most (an even sample of its ranks).
REFERENCE_SAMPLE = 256
#: Points of the iteration-time series at most; longer jobs are drawn in buckets of steps.
MAX_STEP_POINTS = 5000
#: Characters of an axis label; the hover text has the whole name.
LABEL_CHARS = 44
#: Grid points of the W1 integrals (the detectors' ``score_ranks`` default).
_GRID_POINTS = 512
#: Peer ranks drawn next to the suspects in the clusters plot, at most.
_CLUSTER_PEERS = 24
#: Suspect ranks drawn in the clusters plot, at most.
_CLUSTER_SUSPECTS = 8

#: One (kernel, stream).
KernelKey: TypeAlias = tuple[str, int]
#: One rank's clusters of one kernel: counts, p50s and p99s (ns), equally long.
Components: TypeAlias = tuple[Sequence[float], Sequence[float], Sequence[float]]


def plot_text(value: Any) -> str:
    """``value`` as text safe inside a plotly label or hover text (HTML-escaped)."""
    return html.escape(str(value), quote=True)


def short_label(name: str, limit: int = LABEL_CHARS) -> str:
    """``name`` cut to ``limit`` characters, then escaped for plotly. The cut is in the middle (an ellipsis
    marks it): kernel names share long prefixes (``void at::native::...``) and differ at both ends."""
    if len(name) <= limit:
        return plot_text(name)
    head = max(1, (limit - 1) * 11 // 20)
    tail = max(0, limit - 1 - head)
    return plot_text(name[:head] + "\u2026" + (name[-tail:] if tail else ""))


def format_duration(ns: float) -> str:
    """A duration in ns as 3 or so significant digits of a readable unit: ``850 µs``, ``12.3 ms``, ``63.1 s``,
    ``2.50 h``."""
    v = abs(float(ns))
    if not math.isfinite(v):
        return "?"
    scale, unit = next((sc, u) for top, sc, u in ((999.5e3, 1e3, "\u00b5s"), (999.5e6, 1e6, "ms"), (3600e9, 1e9, "s"),
                                                  (math.inf, 3600e9, "h")) if v < top)
    x = float(ns) / scale
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    return f"{x:,.{digits}f} {unit}"


def format_ranks(ranks: Iterable[int], limit: int = 12) -> str:
    """Ranks as sorted ranges, ``"4-7, 12"``; past ``limit`` ranges, ``" (+N more)"``. ``"all"`` for none."""
    rs = sorted({int(r) for r in ranks})
    if not rs:
        return "job-wide"
    runs: list[tuple[int, int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}\u2013{b}" for a, b in runs[:limit]]
    more = sum(b - a + 1 for a, b in runs[limit:])
    return ", ".join(parts) + (f" (+{more} more)" if more else "")


def even_sample(items: Sequence[int], k: int) -> list[int]:
    """``k`` items of ``items`` evenly spaced over it, first and last included (all of them when ``k`` is larger)."""
    if k <= 0:
        return []
    if len(items) <= k:
        return list(items)
    if k == 1:
        return [items[0]]
    idx = np.round(np.linspace(0, len(items) - 1, k)).astype(int)
    return [items[i] for i in dict.fromkeys(idx.tolist())]


def suspect_ranks(findings: Sequence[Mapping[str, Any]]) -> list[int]:
    """The ranks findings name, in the order of the findings (by impact), each once."""
    return list(dict.fromkeys(int(r) for f in findings for r in f.get("ranks") or ()))


@dataclass(frozen=True)
class RankSelection:
    """The ranks a heat map shows (ascending), which of them are suspects, and a sentence saying so."""

    shown: list[int]
    suspects: frozenset[int]
    total: int
    note: str

    def label(self, rank: int) -> str:
        """The axis label of ``rank``: ``"rank 5"``, with a star for a suspect."""
        return f"\u2605 rank {rank}" if rank in self.suspects else f"rank {rank}"


def select_ranks(all_ranks: Iterable[int], suspects: Sequence[int], cap: int = MAX_RANK_ROWS,
                 max_suspects: int = MAX_SUSPECT_ROWS) -> RankSelection:
    """Every rank when there are at most ``cap``; else up to ``max_suspects`` suspects (in the order given: by
    impact) and an even sample of the other ranks up to ``cap`` rows in all."""
    ranks = sorted({int(r) for r in all_ranks} | {int(r) for r in suspects})
    named = list(dict.fromkeys(int(r) for r in suspects))
    if len(ranks) <= cap:
        return RankSelection(ranks, frozenset(named), len(ranks),
                             f"All {len(ranks)} ranks; \u2605 marks the {len(named)} named by findings."
                             if named else f"All {len(ranks)} ranks.")
    kept = named[: min(max_suspects, cap)]
    kept_set = set(kept)
    others = [r for r in ranks if r not in kept_set]
    sample = even_sample(others, cap - len(kept))
    shown = sorted(kept_set | set(sample))
    left = len(named) - len(kept)
    note = (f"{len(shown)} of {len(ranks)} ranks: the {len(kept)} named by the highest-impact findings (\u2605)"
            + (f" ({left} more suspects not shown)" if left else "")
            + f" and an even sample of {len(sample)} of the other {len(others)}.")
    return RankSelection(shown, frozenset(kept), len(ranks), note)


@dataclass(frozen=True)
class HeatMap:
    """A rank x column matrix: ``z[i][j]`` (None: no data) for ``rows[i]`` and ``cols[j]``, plotly-escaped
    labels and hover texts, the colour bar's title and a note on how it was built."""

    rows: list[str]
    cols: list[str]
    z: list[list[float | None]]
    hover: list[list[str]]
    colorbar: str
    note: str
    ranks: list[int] = field(default_factory=list)

    @property
    def cells(self) -> int:
        """Cells with data."""
        return sum(v is not None for row in self.z for v in row)

    def zrange(self, floor: float = 5.0) -> float:
        """The largest ``|z|`` (at least ``floor``): a symmetric colour range around 0."""
        vals = [abs(v) for row in self.z for v in row if v is not None and math.isfinite(v)]
        return max([floor, *vals])


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3g} ms" if ns >= 1e5 else f"{ns / 1e3:.3g} \u00b5s"


def phase_heatmap(phases: Sequence[tuple[str, str, float]], cells: Iterable[tuple[int, str, float, int]],
                  selection: RankSelection) -> HeatMap:
    """Per rank x phase: how much longer (%) the rank's median duration of a phase per step is than the
    median over all ranks.

    ``phases``: the columns in order, ``(name, kind, peer median ns)``. ``cells``: ``(rank, name, median ns per
    step, steps)`` of the shown ranks (others are ignored).
    """
    col = {name: j for j, (name, _, _) in enumerate(phases)}
    row = {r: i for i, r in enumerate(selection.shown)}
    z: list[list[float | None]] = [[None] * len(phases) for _ in selection.shown]
    hover = [[f"{plot_text(selection.label(r))} \u00b7 {plot_text(p[0])}<br>no data" for p in phases]
             for r in selection.shown]
    for rank, name, median_ns, n in cells:
        i, j = row.get(int(rank)), col.get(name)
        if i is None or j is None:
            continue
        peer = float(phases[j][2])
        if peer <= 0:
            continue
        pct = (float(median_ns) / peer - 1.0) * 100.0
        z[i][j] = pct
        hover[i][j] = (f"{plot_text(selection.label(int(rank)))} \u00b7 {plot_text(name)} ({plot_text(phases[j][1])})"
                       f"<br>median {_ms(float(median_ns))} per step over {int(n)} steps"
                       f"<br>all ranks: {_ms(peer)} ({pct:+.1f} %)")
    return HeatMap([selection.label(r) for r in selection.shown], [short_label(p[0]) for p in phases], z, hover,
                   "% vs all ranks",
                   f"{selection.note} Columns: the {len(phases)} phases with the most time, in step order; a cell "
                   "is the rank's median time per step in the phase against the median over all ranks.",
                   list(selection.shown))


@dataclass(frozen=True)
class W1Cell:
    """One rank's W1 to its reference for one kernel (ns), and the same signed (+: slower) over the
    reference's mean duration."""

    w1_ns: float
    relative: float


def _clean(comp: Components) -> tuple[list[float], list[float], list[float]] | None:
    out: tuple[list[float], list[float], list[float]] = ([], [], [])
    for c, p50, p99 in zip(*comp, strict=True):
        c, p50, p99 = float(c), float(p50), float(p99)
        if c > 0 and p50 > 0 and math.isfinite(c) and math.isfinite(p50) and math.isfinite(p99):
            out[0].append(c)
            out[1].append(p50)
            out[2].append(max(p99, p50))
    return out if out[0] else None


def w1_scores(per_rank: Mapping[int, Components], targets: Iterable[int], groups: Mapping[int, int] | None = None,
              sample: int = REFERENCE_SAMPLE, grid_points: int = _GRID_POINTS) -> dict[int, W1Cell]:
    """W1 of each target rank's mixture (all its clusters of one kernel) to its peers' reference: the
    pointwise median CDF of an even sample of up to ``sample`` ranks of its group (``groups``: rank -> group,
    e.g. pipeline stage; None: one group), as the L3 detector does (:mod:`argus.detectors.l3_kernels`).

    Targets without clusters get no entry. A group of one rank is its own reference (0).
    """
    clean = {int(r): c for r, comp in per_rank.items() if (c := _clean(comp)) is not None}
    by_group: dict[int, list[int]] = {}
    for r in sorted(clean):
        by_group.setdefault(0 if groups is None else int(groups.get(r, -1)), []).append(r)
    wanted = {int(t) for t in targets} & set(clean)
    out: dict[int, W1Cell] = {}
    for members in by_group.values():
        tgt = [r for r in members if r in wanted]
        if not tgt:
            continue
        ref = even_sample(members, sample)
        order = list(dict.fromkeys(ref + tgt))
        pos = {r: i for i, r in enumerate(order)}
        owner = np.repeat(np.arange(len(order)), [len(clean[r][0]) for r in order])
        try:
            counts, p50, p99 = (np.concatenate([clean[r][k] for r in order]) for k in range(3))
            batch = MixtureBatch.from_long(owner, counts, p50, p99, n_owners=len(order))
            grid = geometric_grid(batch, points=grid_points)
            cdf = mixture_cdf(batch.counts, batch.p50_ns, batch.p99_ns, grid)
        except DetectorError as exc:
            log.warning("W1 of %d ranks skipped: %s", len(order), exc)
            continue
        reference = np.median(cdf[[pos[r] for r in ref]], axis=0)
        step = np.diff(grid)
        weights = np.zeros(grid.size)
        weights[:-1] += 0.5 * step
        weights[1:] += 0.5 * step
        mean_ref = float(grid[0] + (1.0 - reference) @ weights)
        for r in tgt:
            diff = reference - cdf[pos[r]]
            w1 = float(np.abs(diff) @ weights)
            sign = 1.0 if float(diff @ weights) >= 0 else -1.0
            out[r] = W1Cell(w1, sign * w1 / mean_ref if mean_ref > 0 else 0.0)
    return out


def kernel_labels(kernels: Sequence[KernelKey]) -> list[str]:
    """Axis labels of kernels (escaped, shortened); the stream is named when a name runs on several."""
    names = [k for k, _ in kernels]
    multi = {n for n in names if names.count(n) > 1}
    return [short_label(k) + (f" [s{s}]" if k in multi else "") for k, s in kernels]


def w1_heatmap(kernels: Sequence[tuple[KernelKey, float]], clusters: Mapping[KernelKey, Mapping[int, Components]],
               selection: RankSelection, groups: Mapping[int, int] | None = None,
               grouped: Iterable[KernelKey] = ()) -> tuple[HeatMap, dict[KernelKey, dict[int, W1Cell]]]:
    """Per rank x kernel: W1 of the rank's mixture to its peers' (:func:`w1_scores`), signed, in % of the
    reference mean. ``kernels``: the columns, ``((kernel, stream), GPU ns)``; ``clusters``: each kernel's
    per-rank clusters (the shown ranks and the reference sample); ``groups`` applies to the kernels in
    ``grouped`` (compute kernels: compared within their pipeline stage). Also returns every cell's score."""
    keys = [k for k, _ in kernels]
    grouped_set = set(grouped)
    row = {r: i for i, r in enumerate(selection.shown)}
    z: list[list[float | None]] = [[None] * len(keys) for _ in selection.shown]
    hover = [[f"{plot_text(selection.label(r))} \u00b7 {plot_text(k)}<br>no clusters" for k, _ in keys]
             for r in selection.shown]
    scores: dict[KernelKey, dict[int, W1Cell]] = {}
    for j, (key, gpu_ns) in enumerate(kernels):
        per_rank = clusters.get(key, {})
        cells = w1_scores(per_rank, selection.shown, groups if key in grouped_set else None)
        scores[key] = cells
        for r, cell in cells.items():
            i = row[r]
            n = int(sum(float(c) for c in per_rank[r][0]))
            z[i][j] = cell.relative * 100.0
            hover[i][j] = (f"{plot_text(selection.label(r))} \u00b7 {plot_text(key[0])} (stream {key[1]})"
                           f"<br>W1 to peers {_ms(cell.w1_ns)} ({cell.relative * 100:+.1f} % of their mean)"
                           f"<br>{n} launches; kernel total {gpu_ns / 1e9:.3g} GPU s")
    scope = " (compute kernels within their pipeline stage)" if groups is not None and grouped_set else ""
    return HeatMap([selection.label(r) for r in selection.shown], kernel_labels(keys), z, hover,
                   "W1, % of peer mean",
                   f"{selection.note} Columns: the {len(keys)} kernels with the most GPU time. A cell is the "
                   "1-Wasserstein distance of the rank's duration mixture (its KDE clusters over all windows) to "
                   f"the pointwise-median CDF of its peers{scope}, signed (+: slower), over the peers' mean.",
                   list(selection.shown)), scores


def top_suspect(findings: Sequence[Mapping[str, Any]], scores: Mapping[KernelKey, Mapping[int, W1Cell]]
                ) -> tuple[KernelKey, list[int], str] | None:
    """The kernel of the highest-impact L3 finding that names one (with its ranks), else the (kernel, rank)
    with the largest W1 over the peers' mean; None without kernel data. Returns (kernel, ranks, why)."""
    for f in findings:
        kernel, stream = f.get("kernel"), f.get("stream")
        if f.get("level") == "L3" and kernel is not None:
            key = (str(kernel), int(stream) if stream is not None else 0)
            if key in scores or stream is None:
                return key, [int(r) for r in f.get("ranks") or ()], f"highest-impact L3 finding ({f.get('kind')})"
    best: tuple[float, KernelKey, int] | None = None
    for key, cells in scores.items():
        for r, cell in cells.items():
            if best is None or abs(cell.relative) > best[0]:
                best = (abs(cell.relative), key, r)
    if best is None:
        return None
    return best[1], [best[2]], "largest W1 to its peers (no L3 finding)"


@dataclass(frozen=True)
class ClusterRow:
    """One rank's clusters: p50 and p99 (ns) and launches per cluster."""

    rank: int
    suspect: bool
    counts: list[float]
    p50_ns: list[float]
    p99_ns: list[float]


@dataclass(frozen=True)
class ClusterPlot:
    """The clusters of one kernel on its suspect ranks and a sample of peers."""

    kernel: KernelKey
    rows: list[ClusterRow]
    why: str
    note: str


def cluster_plot(kernel: KernelKey, per_rank: Mapping[int, Components], suspects: Sequence[int], why: str,
                 groups: Mapping[int, int] | None = None) -> ClusterPlot | None:
    """The suspects' (up to 8) and an even sample of peers' (up to 24; of the suspects' groups when
    ``groups`` is given) clusters of ``kernel``; None when no suspect ran it."""
    clean = {int(r): c for r, comp in per_rank.items() if (c := _clean(comp)) is not None}
    sus = [r for r in dict.fromkeys(int(s) for s in suspects) if r in clean][:_CLUSTER_SUSPECTS]
    if not sus:
        return None
    sus_groups = {groups.get(r, -1) for r in sus} if groups is not None else None
    others = [r for r in sorted(clean) if r not in sus and (sus_groups is None or groups is None
                                                           or groups.get(r, -1) in sus_groups)]
    peers = even_sample(others, _CLUSTER_PEERS)
    rows = [ClusterRow(r, r in sus, *clean[r]) for r in sorted(sus) + peers]
    note = (f"{len(sus)} suspect rank(s) against {len(peers)} of {len(others)} peers"
            + (" of the same pipeline stage" if sus_groups is not None else "")
            + ". A dot is one KDE cluster over all windows: its median (p50), a whisker to its p99, area by launches.")
    return ClusterPlot(kernel, rows, why, note)


@dataclass(frozen=True)
class Mark:
    """An L1 finding on the iteration-time axis: a spike step (``line`` False) or an onset/stall (True)."""

    step: int
    label: str
    kind: str
    line: bool


def l1_marks(findings: Sequence[Mapping[str, Any]]) -> list[Mark]:
    """The steps L1 findings point at: every step of an ``iteration_spike``, the onset of a
    ``step_regression``, the step of a ``job_stalled``/``job_resumed`` (labels escaped for plotly)."""
    out: list[Mark] = []
    for f in findings:
        if f.get("level") != "L1" or not f.get("steps"):
            continue
        kind, ev, steps = str(f.get("kind")), f.get("evidence") or {}, [int(s) for s in f["steps"]]
        if kind == FindingKind.ITERATION_SPIKE.value:
            ratio = ev.get("spike_ratio", f.get("score"))
            out += [Mark(s, plot_text(f"spike x{float(ratio):.2f}" if ratio is not None else "spike"), kind, False)
                    for s in steps]
        elif kind == FindingKind.STEP_REGRESSION.value:
            out.append(Mark(steps[0], plot_text(f"regression x{float(f.get('score') or 0):.2f}"), kind, True))
        else:
            out.append(Mark(steps[0], plot_text(kind.replace("_", " ")), kind, True))
    return out


def step_bucket(n_steps: int, first: int, last: int, max_points: int = MAX_STEP_POINTS) -> int:
    """Steps per point of the iteration-time series: 1 up to ``max_points`` steps, else enough to stay under."""
    span = max(n_steps, last - first + 1)
    return max(1, math.ceil(span / max_points))


def _step_range(f: Mapping[str, Any], first: int, last: int) -> tuple[int, int]:
    ev = f.get("evidence") or {}
    steps = [int(s) for s in f.get("steps") or ()]
    if isinstance(ev.get("peak_step"), int):
        at = int(ev["peak_step"])
    elif steps:
        at = min(steps)
    else:
        at = (first + last) // 2
    return max(first, at - 2), min(last, max(at + 2, first))


def drill_commands(job_id: str, database: str, findings: Sequence[Mapping[str, Any]], first_step: int,
                   last_step: int, slowest: Mapping[int, int], top: int = 5) -> list[tuple[str, str]]:
    """Shell commands to look closer, ``(what, command)`` (raw text: escape for HTML): a trace export around
    each of the ``top`` findings (its first rank; for a job-wide one the top suspect of all findings, else the
    slowest rank of the step), the findings as JSON and ``argus sql`` examples. ``slowest``: step -> its slowest
    rank."""

    def sql(statement: str) -> str:
        # Double quotes read better than shlex's '"'"' around the SQL's own quotes, where the shell allows them.
        if any(c in statement for c in '"$`\\!'):
            return "argus sql " + shlex.quote(statement)
        return f'argus sql "{statement}"'

    job = shlex.quote(job_id)
    suspects = suspect_ranks(findings)
    out: list[tuple[str, str]] = []
    seen: set[tuple[int, int, int]] = set()
    for f in findings[:top]:
        a, b = _step_range(f, first_step, last_step)
        ranks = [int(r) for r in f.get("ranks") or ()]
        # A job-wide finding: the top suspect (synchronous ranks all wait for it), else the step's slowest rank.
        rank = ranks[0] if ranks else (suspects[0] if suspects else slowest.get((a + b) // 2, slowest.get(a, 0)))
        if (rank, a, b) in seen:
            continue
        seen.add((rank, a, b))
        what = f"{f.get('level')} {f.get('kind')}" + (f" on {f.get('phase') or f.get('kernel')}"
                                                       if f.get("phase") or f.get("kernel") else "")
        out.append((f"Trace of rank {rank}, steps {a}\u2013{b} ({what})",
                    f"argus export-trace --job {job} --rank {rank} --from-step {a} --to-step {b} "
                    f"--out trace-{_file_part(job_id)}-r{rank}-s{a}.json.gz"))
    out.append(("Every finding with its evidence (JSON contract)", f"argus findings --job {job} --json"))
    lit = sql_string(job_id)
    db = database if database.isidentifier() else f"`{database}`"
    a, b = _step_range(findings[0], first_step, last_step) if findings else (first_step, min(last_step, first_step + 4))
    out.append((f"The slowest rank-steps of steps {a}\u2013{b}",
                sql(f"SELECT rank, step, wall_ns / 1e6 AS wall_ms FROM {db}.steps FINAL WHERE job_id = {lit} "
                    f"AND step BETWEEN {a} AND {b} ORDER BY wall_ms DESC LIMIT 20")))
    kernel = next((f.get("kernel") for f in findings if f.get("kernel")), None)
    if kernel is not None:
        klit = sql_string(str(kernel))
        out.append(("Per-rank windows of the top suspect kernel",
                    sql("SELECT rank, count() AS windows, sum(n_events) AS launches, sum(arraySum(cluster_sum_ns)) "
                        f"/ 1e6 AS gpu_ms FROM {db}.kernel_windows WHERE job_id = {lit} AND kernel = {klit} "
                        "GROUP BY rank ORDER BY gpu_ms DESC LIMIT 20")))
    return out


def _file_part(job_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)[:60] or "job"
