"""The alert rules (deploy/prometheus/rules/) and Alertmanager's example config are valid, their promtool unit
tests pass, every alert is tested, and every metric they read is one the project (or Prometheus) exports.

promtool and amtool come from Debian's ``prometheus`` and ``prometheus-alertmanager`` packages (scripts/test
installs them on a fresh machine); without them these tests fail: the rules would go unchecked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from argus.core.kinds import FindingKind
from argus.metrics import IMPACT_BUCKETS_S, exposition
from argus.streams.compression_router import CompressionStats
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.metrics import WorkerCollector, worker_registry
from tests.compose_config import ROOT
from tests.dashboards import metric_names

RULES = sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))
RULE_TESTS = sorted((ROOT / "deploy/prometheus/tests").glob("*.yml"))
ALERTMANAGER = ROOT / "deploy/alertmanager/alertmanager.yml"


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not on PATH: install Debian's {package} package (scripts/test does)"
    return path


def _run(*cmd: str | Path) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _rules() -> list[dict[str, object]]:
    return [rule for path in RULES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def test_promtool_checks_the_rules() -> None:
    assert RULES
    out = _run(_tool("promtool", "prometheus"), "check", "rules", *RULES)
    assert f"SUCCESS: {len(_rules())} rules found" in out


def test_promtool_unit_tests_of_the_rules_pass_and_cover_every_alert() -> None:
    assert RULE_TESTS
    out = _run(_tool("promtool", "prometheus"), "test", "rules", *RULE_TESTS)
    assert "SUCCESS" in out and "FAILED" not in out
    alerts = {str(r["alert"]) for r in _rules()}
    tested = {t["alertname"] for path in RULE_TESTS for case in yaml.safe_load(path.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    fired = {t["alertname"] for path in RULE_TESTS for case in yaml.safe_load(path.read_text())["tests"]
             for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alerts == tested == fired, (alerts - fired, tested - alerts)


def test_prometheus_config_loads_with_the_rules(tmp_path: Path) -> None:
    """prometheus.yml with its rule_files pointed at the repository's rules: promtool checks both together."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(p) for p in RULES]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    out = _run(_tool("promtool", "prometheus"), "check", "config", local)
    assert f"SUCCESS: {len(_rules())} rules found" in out


def test_amtool_checks_the_alertmanager_config() -> None:
    out = _run(_tool("amtool", "prometheus-alertmanager"), "check-config", ALERTMANAGER)
    assert "SUCCESS" in out
    # Every severity the rules use has a route (the root route takes the rest).
    routes = yaml.safe_load(ALERTMANAGER.read_text())["route"]
    severities = {str(r["labels"]["severity"]) for r in _rules()}  # type: ignore[index]
    assert severities == {"page", "ticket"}
    assert any('severity="page"' in m for r in routes["routes"] for m in r["matchers"])


def test_every_metric_a_rule_reads_is_exported() -> None:
    """argus_* names against the worker's and sink's collectors (the integration test scrapes the real
    processes too); the others are Prometheus's ``up`` of the scrape jobs and the blackbox exporter's
    ``probe_success`` of the query job."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"] for j in config["scrape_configs"]}
    sink_names = set(re.findall(r"_PREFIX \+ \"(\w+)\"", (ROOT / "argus/sinks/metrics.py").read_text()))
    worker = exposition(worker_registry(WorkerCollector(CompressionStats(), DiagnosisStats(),
                                                        consumer=lambda: None)))
    exported = {s.name for fam in text_string_to_metric_families(worker.decode()) for s in fam.samples} | {
        fam.name + suffix for fam in text_string_to_metric_families(worker.decode())
        for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    exported |= {f"argus_sink_{n}{suffix}" for n in sink_names for suffix in ("", "_total", "_bucket", "_count")}
    for rule in _rules():
        expr = str(rule["expr"])
        assert metric_names(expr) <= exported, (rule["alert"], metric_names(expr) - exported)
        others = {n for n in re.findall(r"\b([a-z_]+)\{", expr) if not n.startswith("argus_")}
        assert others <= {"up", "probe_success"}, (rule["alert"], others)
        for job in re.findall(r'(?:up|probe_success)\{job="([^"]+)"', expr):
            assert job in jobs, (rule["alert"], job)
        if "probe_success" in expr:
            assert 'job="argus-query"' in expr
        for le in re.findall(r'le="([^"]+)"', expr):  # a threshold must be a bucket bound to be comparable
            assert float(le) in IMPACT_BUCKETS_S, (rule["alert"], le)


def test_the_impact_histogram_has_every_kind_from_the_start() -> None:
    """increase() needs a series before its first rise: every kind is exported at zero, and a finding lands
    in the buckets by its impact (GPU-seconds per step)."""
    stats = DiagnosisStats()
    stats.observe_impact(FindingKind.COMPUTE_STRAGGLER.value, 2.5e9)  # 2.5 GPU-s per step
    stats.observe_impact(FindingKind.KERNEL_DEGRADED.value, 3e6)
    text = exposition(worker_registry(WorkerCollector(CompressionStats(), stats))).decode()
    samples = {(s.name, s.labels.get("kind"), s.labels.get("le")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    name = "argus_worker_finding_impact_seconds_per_step"
    for kind in FindingKind:
        assert (name + "_count", kind.value, None) in samples, kind
    assert samples[(name + "_count", "compute_straggler", None)] == 1
    assert samples[(name + "_bucket", "compute_straggler", "1.0")] == 0  # above the alert's 1 GPU-s
    assert samples[(name + "_bucket", "compute_straggler", "10.0")] == 1
    assert samples[(name + "_bucket", "kernel_degraded", "0.01")] == 1
    assert samples[(name + "_count", "job_stalled", None)] == 0
    levels = {s.labels["kind"]: s.labels["level"] for fam in text_string_to_metric_families(text)
              for s in fam.samples if s.name == name + "_count"}
    assert all(levels[k.value] == k.level.value for k in FindingKind)
    assert ("argus_worker_stalled_jobs", None, None) in samples
