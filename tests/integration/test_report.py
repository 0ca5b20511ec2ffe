"""``argus report`` end to end: a simulated job with a straggler through Kafka, Faust and chDB, its HTML report
rendered in headless Chromium (the Debian ``chromium``, driven by playwright, never a downloaded browser):
the page draws every plot and the findings table, fetches nothing and logs no console error."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.report import build_report
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

CHROMIUM = os.environ.get("ARGUS_TEST_CHROMIUM", "/usr/bin/chromium")
#: The flags of a browser on a machine without network, and nothing it would phone home for.
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync"]
SCREENSHOT_COPY = Path("/tmp/argus-report-screenshot.png")
PLOTS = ["iteration_time", "phase_heatmap", "kernel_w1_heatmap", "kernel_clusters"]


def _render(page_path: Path, user_data: Path, screenshot: Path) -> dict[str, Any]:
    """Open the page in headless Chromium; wait for the plots; screenshot it; what the browser saw."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium) for this test")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: pip install playwright==1.65.2 (it drives the system "
                    "chromium; no browser download is needed)")

    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(user_data), executable_path=CHROMIUM, headless=True,
                                                   args=BROWSER_ARGS, viewport={"width": 1400, "height": 900})
        try:
            page = ctx.new_page()
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load", timeout=30_000)
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {len(PLOTS)}",
                                   timeout=30_000)
            page.wait_for_timeout(300)  # plotly's responsive relayout after the first paint
            seen = page.evaluate("""() => ({
                plots: [...document.querySelectorAll('.js-plotly-plot')].map(d => d.id),
                svgs: document.querySelectorAll('.js-plotly-plot .main-svg').length,
                heatmaps: document.querySelectorAll('.js-plotly-plot .hm image, .js-plotly-plot .heatmaplayer image')
                    .length,
                points: document.querySelectorAll('#plot-clusters .scatterlayer .point').length,
                rows: document.querySelectorAll('table.findings tbody tr').length,
                commands: [...document.querySelectorAll('pre.cmd')].map(p => p.textContent),
                title: document.title,
            })""")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            ctx.close()
    return {**seen, "errors": errors, "requests": requests}


def test_report_renders(settings: Settings, worker: WorkerProcess, sink: SinkThread, tmp_path: Path) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="rep<1>&", steps=30)
    with Publisher(settings, lossless=True) as pub:
        assert JobSimulator(spec, batch_events=settings.publisher_batch_events).run(pub).dropped == 0
    assert wait_diagnosed(settings, spec.job_id, 120, query=sink.store.query), "diagnosis did not complete"
    time.sleep(1.0)  # findings travel another partition than DIAGNOSED
    findings = fetch_findings(settings, spec.job_id, query=sink.store.query)
    assert {f["level"] for f in findings} >= {"L1", "L2"}

    out = tmp_path / "report" / "report.html"
    started = time.monotonic()
    drawn = build_report(settings, spec.job_id, out, query=sink.store.query)
    build_s = time.monotonic() - started
    assert drawn["plots"] == PLOTS
    assert drawn["findings"] == len(findings) and drawn["ranks"] == spec.world_size == drawn["ranks_shown"]
    assert drawn["steps"] == 30 and drawn["kernels"] > 0 and drawn["phases"] > 0 and drawn["top_kernel"]
    assert drawn["bytes"] == out.stat().st_size < 8_000_000
    text = out.read_text()
    assert text.count("plotly.js v") == 1  # inlined once
    assert "rep<1>&" not in text and "rep&lt;1&gt;&amp;" in text  # the job id is data: escaped
    assert "<script src" not in text and "http-equiv=\"Content-Security-Policy\"" in text

    shot = tmp_path / "report.png"
    seen = _render(out, tmp_path / "chromium-profile", shot)
    assert seen["errors"] == []
    assert all(u.startswith(("file:", "data:", "blob:", "about:")) for u in seen["requests"]), seen["requests"]
    assert seen["plots"] == ["plot-iteration", "plot-phases", "plot-kernels", "plot-clusters"]
    assert seen["svgs"] >= len(PLOTS) and seen["heatmaps"] >= 2 and seen["points"] > 0
    assert seen["rows"] == len(findings)
    assert any("argus export-trace --job 'rep<1>&' --rank 5" in c for c in seen["commands"]), seen["commands"]
    assert shot.stat().st_size > 20_000
    shutil.copyfile(shot, SCREENSHOT_COPY)
    print(f"report {drawn['bytes']} bytes built in {build_s:.2f} s; screenshot {SCREENSHOT_COPY}")


def test_report_of_unknown_job(settings: Settings, sink: SinkThread, tmp_path: Path) -> None:
    with pytest.raises(ArgusError, match="no data for job 'nope'"):
        build_report(settings, "nope", tmp_path / "r.html", query=sink.store.query)
    assert not (tmp_path / "r.html").exists()
