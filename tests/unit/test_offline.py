"""The in-process pipeline (streams.offline) and the job-level link ledger (streams.diagnosis.LinkLedger)."""

from __future__ import annotations

import dataclasses
import json

from producers.faults import Fault
from producers.simulator import JobSimulator, paper_case
from schemas.records import Finding, Level
from streams.diagnosis import LinkLedger
from streams.offline import diagnose_records, finding_json


def _link(ranks: tuple[int, ...], kernel: str, ratio: float, groups: int) -> Finding:
    ev = json.dumps({"transfer_ratio": ratio, "groups_compared": groups})
    return Finding(finding_id=f"{kernel}{ranks}", job_id="j", level=Level.L3, kind="link_degraded", ranks=ranks,
                   steps=(), score=ratio, evidence_json=ev, time_ns=1, kernel=kernel, stream=20)


def test_links_need_two_collectives_or_strong_evidence() -> None:
    ledger = LinkLedger()
    assert ledger.filter([_link((0, 1), "AllReduce", 1.6, 2)]) == []
    assert [f.kernel for f in ledger.filter([_link((0, 1), "AllGather", 1.7, 2)])] == ["AllGather"]
    assert ledger.filter([_link((0, 1), "ReduceScatter", 1.7, 2)]) == []  # each group named once
    assert len(LinkLedger().filter([_link((2, 3), "AllReduce", 3.0, 4)])) == 1
    other = _link((4, 5), "x", 1.0, 1)
    assert LinkLedger().filter([dataclasses.replace(other, kind="kernel_degraded")])  # other kinds pass


def test_the_paper_case_runs_through_the_offline_pipeline_with_impacts() -> None:
    records = (r.record for r in JobSimulator(paper_case(Fault.COMPUTE_STRAGGLER)).records())
    [(_job, findings)] = diagnose_records(records).items()
    assert findings and {r for f in findings for r in f.ranks} == {5}
    assert all(f.impact_ns > 0 and f.impact_ns_per_step > 0 for f in findings)
    out = finding_json(findings[0])
    assert {"impact_ns", "impact_ns_per_step", "evidence", "kind", "ranks"} <= out.keys()
    assert out["evidence"]["delay_ms_per_step"] > 0
