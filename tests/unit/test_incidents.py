"""Incidents: a slow host as one node_degraded incident, stragglers with their kernels, links with their victims."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind, Level
from argus.detectors.findings import finding_id
from argus.detectors.incidents import IncidentParams, by_incident, form_incidents, slow_hosts, with_hosts
from argus.producers.topology import build_topology
from argus.schemas.records import Finding, JobTopology
from argus.streams.job_ledger import JobLedger

JOB = "j"
# dp 8 x tp 4 x pp 2 = 64 ranks on 8 hosts of 8 GPUs; a stage (32 ranks) spans 4 hosts.
TOPO = build_topology(JOB, dp=8, tp=4, pp=2)
HOST1 = tuple(range(8, 16))


def finding(kind: FindingKind, ranks: tuple[int, ...], impact: float = 1e9, kernel: str | None = None,
            stream: int | None = None, steps: tuple[int, ...] = ()) -> Finding:
    level = kind.level
    return Finding(finding_id=finding_id(JOB, level.value, kind.value, ranks, None, kernel, stream, steps),
                   job_id=JOB, level=level, kind=kind, ranks=ranks, steps=steps, score=1.0, evidence_json="{}",
                   time_ns=5, kernel=kernel, stream=stream, impact_ns_per_step=impact / 10, impact_ns=impact)


def slow_host_findings(ranks: tuple[int, ...] = HOST1, kernels: int = 4) -> list[Finding]:
    """What the detectors give for a host whose GPUs all run compute slower: a rank_degraded per rank and a
    kernel_degraded per rank and kernel."""
    out = [finding(FindingKind.RANK_DEGRADED, (r,), 2e9 + r) for r in ranks]
    out += [finding(FindingKind.KERNEL_DEGRADED, (r,), 1e9 + r, kernel=f"gemm{k}", stream=7)
            for r in ranks for k in range(kernels)]
    return out


def incidents(found: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in found:
        out.setdefault(f.incident, []).append(f)
    return out


def test_a_slow_host_is_one_incident_led_by_node_degraded_naming_the_host() -> None:
    found = form_incidents(slow_host_findings(), TOPO)
    assert len(found) == 8 + 32 + 1
    (node,) = [f for f in found if f.kind is FindingKind.NODE_DEGRADED]
    assert node.ranks == HOST1 and node.hosts == ("node0001",) and node.level is Level.L3
    assert node.incident_id == node.finding_id
    assert set(incidents(found)) == {node.finding_id}
    ev = node.evidence
    assert ev["host"] == "node0001" and ev["slow_ranks"] == list(HOST1) and ev["members"] == 40
    assert ev["member_kinds"] == {"kernel_degraded": 32, "rank_degraded": 8} and ev["peer_slow_fraction"] == 0.0
    assert ev["delay_ms_per_step"] == 0.0  # none of the members says (their evidence is empty here)
    # Its impact is its largest member's (eight ranks slow together delay each step once), not their sum.
    assert node.impact_ns == max(f.impact_ns for f in found if f is not node)
    assert all(f.hosts == ("node0001",) for f in found)


def test_five_of_eight_ranks_make_a_host_four_do_not() -> None:
    assert [h.host for h in slow_hosts(slow_host_findings(HOST1[:5]), TOPO)] == ["node0001"]
    assert slow_hosts(slow_host_findings(HOST1[:4]), TOPO) == []
    assert slow_hosts(slow_host_findings(HOST1[:5]), TOPO, IncidentParams(min_host_fraction=0.75)) == []


def test_a_single_slow_rank_is_a_straggler_with_its_kernels_not_a_host() -> None:
    found = form_incidents(slow_host_findings((9,)), TOPO)
    assert not any(f.kind is FindingKind.NODE_DEGRADED for f in found)
    (lead,) = [f for f in found if f.kind is FindingKind.RANK_DEGRADED]
    assert set(incidents(found)) == {lead.finding_id}


def test_two_stragglers_on_one_host_are_two_incidents() -> None:
    found = form_incidents(slow_host_findings((9, 12)), TOPO)
    assert not any(f.kind is FindingKind.NODE_DEGRADED for f in found)
    assert len(incidents(found)) == 2


def test_ranks_slow_because_their_stage_is_are_no_host_fault() -> None:
    stage = tuple(range(32, 64))  # stage 1: hosts 4-7
    found = slow_host_findings(tuple(range(32, 40)))
    stage_slow = finding(FindingKind.PP_STAGE_SLOW, stage, 5e9)
    out = form_incidents([*found, stage_slow], TOPO)
    assert not any(f.kind is FindingKind.NODE_DEGRADED for f in out)
    assert set(incidents(out)) == {stage_slow.finding_id}


def test_ranks_slow_with_their_stage_peers_on_other_hosts_are_no_host_fault() -> None:
    # Hosts 0 and 1 (half of stage 0) slow: each host's stage peers on other hosts are 8/24 slow.
    found = slow_host_findings(tuple(range(0, 16)), kernels=1)
    assert slow_hosts(found, TOPO) == []
    assert slow_hosts(found, TOPO, IncidentParams(max_peer_fraction=0.4)) != []


def test_a_host_that_is_its_whole_stage_or_job_is_no_host_fault() -> None:
    one_host_stages = build_topology(JOB, dp=2, tp=4, pp=4)  # each stage is one host of 8
    assert slow_hosts(slow_host_findings(tuple(range(8, 16))), one_host_stages) == []
    single = build_topology(JOB, dp=8)
    assert slow_hosts(slow_host_findings(tuple(range(8))), single) == []


def test_link_findings_of_one_group_and_its_late_arrivals_are_one_incident() -> None:
    group = (4, 5, 6, 7)
    big = finding(FindingKind.LINK_DEGRADED, group, 3e9, kernel="ncclAllReduce", stream=20)
    small = finding(FindingKind.LINK_DEGRADED, group, 1e9, kernel="ncclAllGather", stream=20)
    late = finding(FindingKind.LATE_ARRIVAL, (5,), 5e8, kernel="ncclAllReduce", stream=24)
    other = finding(FindingKind.LINK_DEGRADED, (0, 1, 2, 3), 2e9, kernel="ncclAllReduce", stream=20)
    out = incidents(form_incidents([small, late, big, other], TOPO))
    assert {k: {f.finding_id for f in v} for k, v in out.items()} == {
        big.finding_id: {big.finding_id, small.finding_id, late.finding_id}, other.finding_id: {other.finding_id}}


def test_a_step_regression_joins_the_only_cause_and_stands_alone_beside_two() -> None:
    reg = finding(FindingKind.STEP_REGRESSION, (), 9e9, steps=(4,))
    out = form_incidents([*slow_host_findings(), reg], TOPO)
    assert len(incidents(out)) == 1
    two = form_incidents([*slow_host_findings(), reg, finding(FindingKind.RANK_DEGRADED, (40,))], TOPO)
    assert len(incidents(two)) == 3
    spike = finding(FindingKind.ITERATION_SPIKE, (), 1e9, steps=(7,))
    assert len(incidents(form_incidents([*slow_host_findings(), spike], TOPO))) == 2


def test_without_a_topology_there_are_no_hosts_but_stragglers_still_fold() -> None:
    out = form_incidents(slow_host_findings((3,)), None)
    assert all(f.hosts == () for f in out) and len(incidents(out)) == 1


def test_a_host_incident_once_raised_stays_as_more_findings_come() -> None:
    first = form_incidents(slow_host_findings(), TOPO)
    node = next(f for f in first if f.kind is FindingKind.NODE_DEGRADED)
    # Only the node and one kernel finding of the host known (another worker published the rest).
    later = form_incidents([node, finding(FindingKind.KERNEL_DEGRADED, (9,), 1e8, kernel="x", stream=7)], TOPO)
    assert {f.incident for f in later} == {node.finding_id}


@pytest.mark.parametrize("kw", [{"min_host_ranks": 1}, {"min_host_fraction": 0.5}, {"min_host_fraction": 1.1},
                                {"max_peer_fraction": 0.5}, {"max_peer_fraction": -0.1}])
def test_params_are_validated(kw: dict[str, float]) -> None:
    with pytest.raises(DetectorError):
        IncidentParams(**kw)  # type: ignore[arg-type]


def test_by_incident_puts_the_largest_incident_first_and_its_lead_first() -> None:
    items = [("a", "a", 1.0), ("b", "c", 9.0), ("c", "c", 2.0), ("d", "", 5.0)]
    groups = by_incident(items, lambda i: i[0], lambda i: i[1], lambda i: i[2])
    assert [[i[0] for i in g] for g in groups] == [["c", "b"], ["d"], ["a"]]


def test_with_hosts_names_every_host_of_a_findings_ranks_once() -> None:
    (f,) = with_hosts([finding(FindingKind.LINK_DEGRADED, (6, 7, 8, 9))], TOPO)
    assert f.hosts == ("node0000", "node0001")


_KINDS = [FindingKind.RANK_DEGRADED, FindingKind.KERNEL_DEGRADED, FindingKind.LATE_ARRIVAL,
          FindingKind.COMPUTE_STRAGGLER, FindingKind.LINK_DEGRADED, FindingKind.PP_STAGE_SLOW,
          FindingKind.STEP_REGRESSION]


@st.composite
def findings_of_a_job(draw: st.DrawFn) -> list[Finding]:
    out: dict[str, Finding] = {}
    if draw(st.booleans()):
        host = draw(st.integers(0, 7))
        for f in slow_host_findings(tuple(range(8 * host, 8 * host + 8)), kernels=draw(st.integers(0, 3))):
            out[f.finding_id] = f
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(_KINDS))
        if kind is FindingKind.STEP_REGRESSION:
            ranks: tuple[int, ...] = ()
        elif kind is FindingKind.PP_STAGE_SLOW:
            ranks = tuple(range(32)) if draw(st.booleans()) else tuple(range(32, 64))
        else:
            first = draw(st.integers(0, 63))
            ranks = tuple(sorted({first, *draw(st.lists(st.integers(0, 63), max_size=3))})) \
                if kind is FindingKind.LINK_DEGRADED else (first,)
        f = finding(kind, ranks, draw(st.floats(1e6, 1e10)), kernel=draw(st.sampled_from([None, "g1", "g2"])),
                    stream=7, steps=(3,) if kind is FindingKind.STEP_REGRESSION else ())
        out[f.finding_id] = f
    return list(out.values())


@settings(max_examples=120, deadline=None)
@given(findings_of_a_job(), st.randoms(use_true_random=False))
def test_grouping_keeps_every_finding_is_idempotent_and_ignores_order(found: list[Finding],
                                                                       rnd: random.Random) -> None:
    out = form_incidents(found, TOPO)
    ids = {f.finding_id for f in out}
    assert {f.finding_id for f in found} <= ids and len(ids) == len(out)
    by_id = {f.finding_id: f for f in out}
    for f in out:  # every incident is led by a finding of the job, which leads its own
        assert by_id[f.incident].incident == f.incident
    assert form_incidents(out, TOPO) == out
    shuffled = list(found)
    rnd.shuffle(shuffled)
    assert {f.finding_id: f.incident for f in form_incidents(shuffled, TOPO)} == {f.finding_id: f.incident
                                                                               for f in out}
    nodes = Counter(f.hosts for f in out if f.kind is FindingKind.NODE_DEGRADED)
    assert all(n == 1 for n in nodes.values())


def test_the_ledger_publishes_host_findings_and_regroups_what_it_published_before() -> None:
    ledger = JobLedger("v+1")
    ledger.topologies[JOB] = TOPO
    kernels = [f for f in slow_host_findings() if f.kind is FindingKind.KERNEL_DEGRADED]
    ranks = [f for f in slow_host_findings() if f.kind is FindingKind.RANK_DEGRADED]
    first = ledger.publishable(kernels[:4])  # one rank's kernels: no host yet, hosts stamped
    assert len(first) == 4 and all(f.hosts == ("node0001",) and f.detector_version == "v+1" for f in first)
    assert ledger.publishable(kernels[:4]) == ()  # published once
    second = ledger.publishable(kernels[4:] + ranks)
    node = next(f for f in second if f.kind is FindingKind.NODE_DEGRADED)
    # Everything of the host now belongs to the node's incident, the four published first again (same ids).
    assert {f.finding_id for f in second} == {f.finding_id for f in kernels + ranks} | {node.finding_id}
    assert {f.incident for f in second} == {node.finding_id}
    assert ledger.publishable(ranks) == ()


def _topology_hosts(topo: JobTopology) -> set[str]:
    return set(topo.host)


def test_the_test_topology_has_eight_hosts_of_eight() -> None:
    assert len(_topology_hosts(TOPO)) == 8 and Counter(TOPO.host).most_common(1)[0][1] == 8


def test_argus_findings_shows_incidents_first_with_members_folded(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from argus import cli
    from argus.sinks import findings_query
    from argus.streams.offline import ordered_json

    straggler = finding(FindingKind.RANK_DEGRADED, (40,), 9e9)
    rows = ordered_json(form_incidents([*slow_host_findings(kernels=2), straggler], TOPO))
    monkeypatch.setattr(findings_query, "fetch_findings", lambda settings, job: list(reversed(rows)))
    for key in [k for k in __import__("os").environ if k.startswith("ARGUS_")]:
        monkeypatch.delenv(key)
    assert cli.main(["findings", "--job", JOB]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 2  # header, rule, one row per incident
    assert "rank_degraded" in lines[2] and "node0005" in lines[2] and lines[2].rstrip().endswith("-")
    assert "node_degraded" in lines[3] and "node0001" in lines[3] and "16 kernel_degraded, 8 rank_degraded" in lines[3]
    assert cli.main(["findings", "--job", JOB, "--members"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 2 + 24 and all(line.startswith("+") for line in lines[4:])
    # The JSON contract: one flat array, incidents by impact, each lead then its members.
    assert [f["finding_id"] for f in rows[:2]] == [straggler.finding_id, rows[1]["incident_id"]]
    assert rows[1]["kind"] == "node_degraded" and {f["incident_id"] for f in rows[1:]} == {rows[1]["finding_id"]}
    assert cli.main(["findings", "--job", JOB, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == list(reversed(rows))  # what fetch_findings gave, as it gave it


def test_a_simulated_slow_host_runs_through_the_pipeline_as_one_incident() -> None:
    from argus.producers.faults import FaultSpec
    from argus.producers.simulator import JobSimulator, JobSpec
    from argus.streams.offline import diagnose_records

    topo = build_topology("sh", dp=8, tp=4)  # 32 ranks, 4 hosts, one stage
    spec = JobSpec("sh", dp=8, tp=4, steps=20, fault=FaultSpec.slow_host(topo, "node0002"))
    [(_job, found)] = diagnose_records(r.record for r in JobSimulator(spec).records()).items()
    (node,) = [f for f in found if f.kind is FindingKind.NODE_DEGRADED]
    assert node.hosts == ("node0002",) and node.ranks == tuple(range(16, 24))
    assert {f.incident for f in found} == {node.finding_id} and len(found) > 8
    assert {r for f in found for r in f.ranks} == set(node.ranks) and node.impact_ns > 0
    assert node.evidence["delay_ms_per_step"] == max(f.evidence["delay_ms_per_step"] for f in found if f is not node)
    with pytest.raises(ValueError, match="no rank runs on host"):
        FaultSpec.slow_host(topo, "elsewhere")
