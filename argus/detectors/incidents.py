"""Incidents: the findings of a job that share one cause, grouped under one lead finding (pure).

A slow host whose eight GPUs all run compute 1.3x slower is found by the detectors one rank and one kernel at a
time (a ``rank_degraded`` finding per rank, a ``kernel_degraded`` per rank and kernel): dozens of findings for one
thing to fix. :func:`form_incidents` stamps every finding with the hosts of its ranks and groups findings by
cause; each finding's ``incident_id`` is the ``finding_id`` of its incident's lead. The rules, in order (a finding
joins the first incident that claims it), and their reasons: docs/incidents.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind, Level
from argus.detectors.findings import finding_id
from argus.schemas.records import Finding, JobTopology

__all__ = ["SLOW_KINDS", "HostFault", "IncidentParams", "by_incident", "form_incidents", "slow_hosts", "with_hosts"]

#: Findings that name ranks slow (by their own work, or late to a collective): what a slow host shows as.
SLOW_KINDS = frozenset({FindingKind.RANK_DEGRADED, FindingKind.COMPUTE_STRAGGLER, FindingKind.KERNEL_DEGRADED,
                        FindingKind.PHASE_STRAGGLER, FindingKind.LATE_ARRIVAL})
#: Straggler leads, the first kind first.
_STRAGGLER_LEADS = (FindingKind.RANK_DEGRADED, FindingKind.COMPUTE_STRAGGLER)
_T = TypeVar("_T")


@dataclass(frozen=True)
class IncidentParams:
    """When the ranks of one host are one incident (see the module docstring).

    Raises :class:`DetectorError` for a value out of range.
    """

    #: Least number of a host's ranks named slow (a single slow rank is a straggler, not a host).
    min_host_ranks: int = 2
    #: Least fraction of a host's ranks named slow: a majority (5 of 8, 3 of 4, 2 of 2; docs/incidents.md).
    min_host_fraction: float = 0.6
    #: Largest fraction of their stage peers on other hosts named slow too (more: the slowness is wider).
    max_peer_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.min_host_ranks < 2:
            raise DetectorError(f"min_host_ranks must be >= 2, got {self.min_host_ranks}")
        if not 0.5 < self.min_host_fraction <= 1.0:
            raise DetectorError(f"min_host_fraction must be in (0.5, 1], got {self.min_host_fraction}")
        if not 0.0 <= self.max_peer_fraction < 0.5:
            raise DetectorError(f"max_peer_fraction must be in [0, 0.5), got {self.max_peer_fraction}")


@dataclass(frozen=True)
class HostFault:
    """A host whose ranks are slow together: ``ranks`` all its ranks, ``slow`` those named slow, ``peer_fraction``
    the fraction of their stage peers on other hosts named slow too, ``gpus`` the GPU ids of ``ranks`` (empty
    when unknown)."""

    host: str
    ranks: tuple[int, ...]
    slow: tuple[int, ...]
    peer_fraction: float
    gpus: tuple[str, ...] = ()


def with_hosts(findings: Iterable[Finding], topology: JobTopology | None) -> list[Finding]:
    """``findings`` with ``hosts`` (the sorted hosts of their ranks) and ``gpus`` (each rank's GPU id), as they
    were where the topology does not know them."""
    if topology is None:
        return list(findings)
    host_of = dict(zip(topology.rank, topology.host, strict=True))
    gpu_of = dict(zip(topology.rank, topology.gpu, strict=True)) if topology.gpu else {}
    out = []
    for f in findings:
        hosts = tuple(sorted({host_of[r] for r in f.ranks if host_of.get(r)})) or f.hosts
        gpus = tuple(gpu_of.get(r, "") for r in f.ranks)
        gpus = gpus if any(gpus) else f.gpus
        out.append(f if (hosts, gpus) == (f.hosts, f.gpus) else dataclasses.replace(f, hosts=hosts, gpus=gpus))
    return out


def slow_hosts(findings: Sequence[Finding], topology: JobTopology, params: IncidentParams | None = None
               ) -> list[HostFault]:
    """The hosts whose ranks are slow together beyond what their groups explain (rule 1 of the module docstring),
    by host name."""
    p = params if params is not None else IncidentParams()
    slow = {r for f in findings if f.kind in SLOW_KINDS for r in f.ranks}
    stages = [set(f.ranks) for f in findings if f.kind is FindingKind.PP_STAGE_SLOW]
    ranks_of: dict[str, list[int]] = defaultdict(list)
    for r, h in zip(topology.rank, topology.host, strict=True):
        if h:
            ranks_of[h].append(r)
    if len(ranks_of) < 2:
        return []
    stage_of = dict(zip(topology.rank, topology.pp_stage, strict=True))
    gpu_of = dict(zip(topology.rank, topology.gpu, strict=True)) if topology.gpu else {}
    by_stage: dict[int, set[int]] = defaultdict(set)
    for r, st in stage_of.items():
        by_stage[st].add(r)
    out = []
    for host, ranks in sorted(ranks_of.items()):
        mine = slow.intersection(ranks)
        if len(mine) < p.min_host_ranks or len(mine) < p.min_host_fraction * len(ranks):
            continue
        if any(mine <= stage for stage in stages):
            continue  # their pipeline stage is slow as a whole
        peers = set().union(*(by_stage[stage_of[r]] for r in mine)) - set(ranks)
        if not peers:
            continue  # the host is its stages: nothing beside it to compare with
        frac = len(peers & slow) / len(peers)
        if frac <= p.max_peer_fraction:
            ordered = tuple(sorted(ranks))
            gpus = tuple(gpu_of.get(r, "") for r in ordered)
            out.append(HostFault(host, ordered, tuple(sorted(mine)), frac, gpus if any(gpus) else ()))
    return out


def form_incidents(findings: Iterable[Finding], topology: JobTopology | None,
                   params: IncidentParams | None = None) -> list[Finding]:
    """``findings`` of one job with their hosts and incident ids, and a ``node_degraded`` finding for each slow
    host (:func:`slow_hosts`, and each host with one in ``findings`` already), in input order with the new
    host findings first. Without a topology hosts are unknown: no host incident, the other rules apply."""
    found = [f for f in with_hosts(findings, topology) if f.kind is not FindingKind.NODE_DEGRADED]
    earlier = {f.finding_id: f for f in findings if f.kind is FindingKind.NODE_DEGRADED}
    leads: list[tuple[Finding, Callable[[Finding], bool]]] = []
    nodes: list[Finding] = []
    faults = {h.host: h for h in slow_hosts(found, topology, params)} if topology is not None else {}
    for f in earlier.values():
        if f.hosts and f.hosts[0] not in faults:  # raised before: stays
            faults[f.hosts[0]] = HostFault(f.hosts[0], f.ranks, tuple(f.evidence.get("slow_ranks", f.ranks)),
                                           float(f.evidence.get("peer_slow_fraction", 0.0)), f.gpus)
    for fault in sorted(faults.values(), key=lambda h: h.host):
        members = [f for f in found if f.kind in SLOW_KINDS and f.ranks and set(f.ranks) <= set(fault.ranks)]
        node = _node_finding(fault, members, earlier)
        nodes.append(node)
        leads.append((node, _within(node.ranks, SLOW_KINDS)))
    # Within a rule the lead of largest impact claims first (ties by id): the grouping does not depend on the
    # order the findings came in.
    for f in _largest_first(found, FindingKind.PP_STAGE_SLOW):
        leads.append((f, _within(f.ranks, SLOW_KINDS)))
    for f in _largest_first(found, FindingKind.LINK_DEGRADED):
        leads.append((f, _same_link(f)))
    for kind in _STRAGGLER_LEADS:
        for f in _largest_first(found, kind):
            leads.append((f, _within(f.ranks, SLOW_KINDS)))
    incident: dict[str, str] = {}
    for lead, claims in leads:
        if lead.finding_id in incident:
            continue  # claimed by an earlier incident: its members go with it
        incident[lead.finding_id] = lead.finding_id
        for f in found:
            if f.finding_id not in incident and claims(f):
                incident[f.finding_id] = lead.finding_id
    out = nodes + found
    causes = {incident.get(f.finding_id, f.finding_id) for f in out if f.level is not Level.L1}
    if len(causes) == 1:
        (cause,) = causes
        for f in found:
            if f.kind is FindingKind.STEP_REGRESSION:
                incident[f.finding_id] = cause
    return [f if f.incident_id == incident.get(f.finding_id, f.finding_id)
            else dataclasses.replace(f, incident_id=incident.get(f.finding_id, f.finding_id)) for f in out]


def by_incident(items: Iterable[_T], finding_of: Callable[[_T], str], incident_of: Callable[[_T], str],
                impact_of: Callable[[_T], float]) -> list[list[_T]]:
    """``items`` (findings, or their JSON objects) grouped by incident: each incident its lead first (the item
    whose finding id is the incident's), then its members by impact, largest first (equal ones in input order);
    incidents by their largest impact, largest first. An item with no incident id is its own incident; one whose
    lead is missing stays with the other members of its incident."""
    groups: dict[str, list[_T]] = defaultdict(list)
    for it in items:
        groups[incident_of(it) or finding_of(it)].append(it)

    def order(key: str) -> tuple[float, str]:
        return (-max(impact_of(i) for i in groups[key]), key)

    out = []
    for key in sorted(groups, key=order):
        members = sorted(groups[key], key=lambda i: (finding_of(i) != key, -impact_of(i)))  # stable: ties keep order
        out.append(members)
    return out


def _delay_ms(f: Finding) -> float:
    """The delay a finding adds per step (its evidence's ``delay_ms_per_step``, ms; 0 where it has none)."""
    value = f.evidence.get("delay_ms_per_step")
    return float(value) if isinstance(value, (int, float)) else 0.0


def _largest_first(found: Iterable[Finding], kind: FindingKind) -> list[Finding]:
    return sorted((f for f in found if f.kind is kind), key=lambda f: (-f.impact_ns, f.finding_id))


def _same_link(link: Finding) -> Callable[[Finding], bool]:
    """Whether a finding is another collective of ``link``'s group, or a late arrival within the group."""
    group = set(link.ranks)
    return lambda f: ((f.kind is FindingKind.LINK_DEGRADED and f.ranks == link.ranks)
                      or (f.kind is FindingKind.LATE_ARRIVAL and set(f.ranks) <= group))


def _within(ranks: Iterable[int], kinds: frozenset[FindingKind]) -> Callable[[Finding], bool]:
    """Whether a finding is of ``kinds`` and names ranks within ``ranks`` only."""
    allowed = set(ranks)
    return lambda f: f.kind in kinds and bool(f.ranks) and set(f.ranks) <= allowed


def _node_finding(fault: HostFault, members: Sequence[Finding], earlier: dict[str, Finding]) -> Finding:
    """The ``node_degraded`` finding of ``fault``: its id from the job and the host's ranks only (stable as
    members come); its impact, score and time the largest of its members' (members overlap: eight ranks slow
    together delay each step once), its evidence what the host rule read."""
    job = next((m.job_id for m in members), None) or next(iter(earlier.values())).job_id
    fid = finding_id(job, Level.L3.value, FindingKind.NODE_DEGRADED.value, fault.ranks, None, None, None, ())
    if not members and fid in earlier:
        return dataclasses.replace(earlier[fid], incident_id=fid)
    kinds = Counter(m.kind.value for m in members)
    evidence = {"host": fault.host, "host_ranks": len(fault.ranks), "slow_ranks": list(fault.slow),
                "slow_fraction": round(len(fault.slow) / len(fault.ranks), 4),
                "peer_slow_fraction": round(fault.peer_fraction, 4), "members": len(members),
                "member_kinds": dict(sorted(kinds.items())),
                "delay_ms_per_step": max((_delay_ms(m) for m in members), default=0.0)}
    best = max(members, key=lambda m: (m.impact_ns, m.score), default=None)
    return Finding(
        finding_id=fid, job_id=job, level=Level.L3, kind=FindingKind.NODE_DEGRADED, ranks=fault.ranks, steps=(),
        score=max((m.score for m in members), default=0.0), evidence_json=json.dumps(evidence, sort_keys=True,
                                                                                       separators=(",", ":")),
        time_ns=max((m.time_ns for m in members), default=0),
        impact_ns_per_step=best.impact_ns_per_step if best is not None else 0.0,
        impact_ns=best.impact_ns if best is not None else 0.0,
        detector_version=best.detector_version if best is not None else "", hosts=(fault.host,), incident_id=fid,
        gpus=fault.gpus)
