"""A job's link ledger: degraded-link findings held back until one group's link is corroborated (pure).

One collective of a grouping guessed from durations can mislead (ranks of one position waiting in a collective
of another kind look like a slow group of their own), so :class:`LinkLedger` names a group's link once its
evidence (:class:`~argus.detectors.links.LinkEvidence`) holds in two collectives, in a named group, or
strongly (:class:`~argus.detectors.links.LinkParams`); a pipeline link seen one side per stream is named once
both of its sides are slow, and where the job's final judgement pairs them, only once its ranks are judged too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from argus.core.kinds import FindingKind
from argus.detectors.findings import evidence_json, finding_id
from argus.detectors.links import (
    CORROBORATES_ONLY,
    IMPACT_BAR_SHARE,
    LinkEvidence,
    LinkParams,
    PseudoGroup,
    corroborates_only,
)
from argus.detectors.victims import straggler_ranks
from argus.schemas.records import Finding, ParallelGroup

__all__ = ["LinkLedger"]

_LINK_KEYS = frozenset({f.name for f in dataclasses.fields(LinkEvidence)} | {"p50_ratio"})


class LinkLedger:
    """Job-level check of degraded-link findings: a group's link is named once its evidence holds in two
    collectives ((kernel, stream) pairs: a degraded link slows every collective its group runs), in one whose
    group is known (the trace named the process group of the stream: ``group_known``), or in one with strong
    evidence (transfer ``strong_ratio``x slower than ``strong_groups`` or more groups of its kind, or the only
    slow one of ``strong_groups`` or more in three or more stages, each compared with its stage's; never
    where ``several_slow`` or more groups of the kind are slow in that collective; see :class:`LinkParams`).

    One collective of a group inferred from durations alone can mislead: the ranks of one position in their
    groups (all of one TP index) can wait in a collective of another kind for the others and look like a slow
    group of their own kind. A pipeline link seen one side per stream (:attr:`PseudoGroup.PP_SIDE`) is named
    once both of its ranks' sides are slow, or one slow and one corroborating, or both corroborating alike
    (:func:`_ends_agree`), and only while no straggler is known in the job; a pair formed by
    the job's final judgement is held until :meth:`release` (after the job's rank aggregate, which can name the
    straggler its sides wait for).
    """

    def __init__(self, params: LinkParams | None = None) -> None:
        self.params = params if params is not None else LinkParams()
        self._seen: dict[tuple[int, ...], dict[tuple[str, int], Finding]] = {}
        self._named: set[tuple[int, ...]] = set()
        self._raised: set[tuple[tuple[int, ...], str, int]] = set()  # (group, kernel, stream) published
        self._sides: dict[int, dict[int, Finding]] = {}  # pipeline -> stage -> that stage's side
        self._stragglers: set[int] = set()  # ranks named slow by their own work, from the findings seen
        self._both_slow: set[int] = set()  # ranks of pipeline pairs named with both sides slow (not corroborating)
        self._final_pairs: list[Finding] = []  # pipeline pairs of the final judgement, until release()

    def filter(self, findings: list[Finding], final: bool = False) -> list[Finding]:
        """``findings`` with link findings held back until their group is corroborated (then each of its
        collectives once) and corroboration-only findings (:func:`corroborates_only`) removed. ``final``: the
        findings of the job's final judgement, whose pipeline pairs wait for :meth:`release`."""
        out = []
        self._stragglers |= straggler_ranks(findings)
        # Sides slow by evidence of their own first: a slow link's pair is named before a neighbour of it that
        # only waits for it (stable: the order is otherwise kept).
        for f in sorted(findings, key=lambda g: g.kind is FindingKind.LINK_DEGRADED and corroborates_only(g)):
            if f.kind is not FindingKind.LINK_DEGRADED:
                out.append(f)
                continue
            ev = LinkEvidence.from_dict(f.evidence)
            if ev.group_kind is PseudoGroup.PP_SIDE:
                pairs = self._pair(f, ev)
                if final:
                    self._final_pairs += pairs
                else:
                    out += pairs
                continue
            group = tuple(f.ranks)
            seen = self._seen.setdefault(group, {})
            key = (f.kernel or "", f.stream or 0)
            if key not in seen or corroborates_only(seen[key]):
                seen[key] = f
            raisable = [g for g in seen.values() if not corroborates_only(g)]
            if not raisable and self._costs_together(seen.values()):
                raisable = [_raisable(g) for g in seen.values()]
            if group not in self._named and not (len(seen) >= 2 or any(self._named_alone(g) for g in raisable)):
                continue
            self._named.add(group)
            # Each corroborated collective of the group once: which of them a worker judges first depends on
            # timing and on the worker that holds it, so naming only the first would not be one answer.
            for g in raisable:
                done = (group, g.kernel or "", g.stream or 0)
                if done not in self._raised:
                    self._raised.add(done)
                    out.append(g)
        return out

    def release(self) -> list[Finding]:
        """The pipeline pairs the final judgement held, once the job's ranks are judged: none where a straggler
        is known by then (its pipeline and data-parallel peers wait for it: their sides are no link)."""
        held, self._final_pairs = self._final_pairs, []
        return [] if self._stragglers else held

    @staticmethod
    def _costs_together(held: Iterable[Finding]) -> bool:
        """Whether a group's collectives, each held back for its impact (or as weak evidence), cost the job
        enough together: a link costs what its collectives cost together. At least one of them must be
        evidence enough of the link (a weak one only adds its cost)."""
        found = [(LinkEvidence.from_dict(g.evidence), float(g.evidence.get(IMPACT_BAR_SHARE, 0.0))) for g in held]
        return any(not ev.weak for ev, _ in found) and sum(share for _, share in found) >= 1.0

    def _named_alone(self, f: Finding) -> bool:
        """Whether one collective names the group: the trace named it, or the evidence is strong."""
        ev = LinkEvidence.from_dict(f.evidence)
        return self._strong(ev) or ev.group_known

    def _pair(self, f: Finding, ev: LinkEvidence) -> list[Finding]:
        """A pipeline link from its two sides: one rank's transfers slow against its stage's peers on one
        stream, and its neighbour's in the same pipeline on theirs. A rank waiting for a slow peer shows one
        side only (the slow peer itself posts last and never waits), so one side is never named."""
        if self._stragglers or ev.pp_group is None or ev.pp_stage is None:
            # Waiting spreads from a straggler through every blocking group: up its pipeline, and through its
            # stage's data-parallel peers into theirs; sides alone cannot tell a link from it.
            return []
        pipe, stage = int(ev.pp_group), int(ev.pp_stage)
        sides = self._sides.setdefault(pipe, {})
        if stage not in sides or corroborates_only(sides[stage]):
            sides[stage] = f
        out = []
        for other in (stage - 1, stage + 1):
            g = sides.get(other)
            if g is None:
                continue
            ends = corroborates_only(f) and corroborates_only(g)
            if ends and not _ends_agree(f, g, self.params):
                continue
            ranks = tuple(sorted({*f.ranks, *g.ranks}))
            weak = corroborates_only(f) or corroborates_only(g)
            # A slow link makes the sides next to it wait (its pipeline's next stage waits for what it carries):
            # a side named with its other neighbour, both slow, pairs with no side that only corroborates.
            if ranks in self._named or (weak and self._both_slow & set(ranks)):
                continue
            self._named.add(ranks)
            if not weak:
                self._both_slow.update(ranks)
            top = max((x for x in (f, g) if ends or not corroborates_only(x)), key=lambda x: x.impact_ns)
            ratios = {str(x.ranks[0]): LinkEvidence.from_dict(x.evidence).transfer_ratio for x in (f, g)}
            out.append(_pipeline_pair(top, pipe, ranks, ratios))
        return out

    def _strong(self, ev: LinkEvidence) -> bool:
        p = self.params
        # Compared with its own stage's groups only, a group is still one among ``kind_groups`` of its kind:
        # the only slow one of ``strong_groups`` or more, in three or more stages (comparisons) each even but
        # its own, is as strong as one slow against as many.
        many = ev.groups_compared >= p.strong_groups or (
            ev.kind_slow_groups == 1 and ev.kind_groups >= p.strong_groups and ev.kind_comparisons >= 3)
        # Several groups of the guessed kind slow in one collective are what ranks of one position waiting in a
        # collective of another kind look like (a DP reduce-scatter's members waiting for a straggler, seen as
        # TP pairs), not one link: one collective of them is no strong evidence.
        # The ratio read low in the mode too: the healthy groups' typical calls hold waiting that their fast
        # ones (nearer the transfer) do not, so a group slow in every call is often more slower there.
        ratio = max(ev.transfer_ratio, ev.low_transfer_ratio)
        return ratio >= p.strong_ratio and many and ev.kind_slow_groups < p.several_slow


def _ends_agree(f: Finding, g: Finding, p: LinkParams) -> bool:
    """Whether two neighbouring sides that each only corroborate name their link together: of two or three
    pipelines (no z-score to judge by), each is its stage's only side slower at its fast calls (evidence
    ``weak``), their transfer ratios are alike (``ends_alike``: both ends time the same transfers, where
    waiting in a healthy pipeline reads at unrelated ratios), and the larger one's delay is over the impact
    bar. A rank waiting for a straggler slows one side only (the straggler posts last and never waits). Of
    more pipelines a weak side is only the slowest of many short of the z-score: two such neighbours with like
    ratios were seen in healthy jobs of 32 pipelines, so there one end must be slow by its own evidence."""
    evs = [LinkEvidence.from_dict(x.evidence) for x in (f, g)]
    lo, hi = sorted(e.transfer_ratio for e in evs)
    return (all(e.weak and e.groups_compared < p.spread_set for e in evs) and hi <= p.ends_alike * lo
            and max(float(x.evidence.get(IMPACT_BAR_SHARE, 0.0)) for x in (f, g)) >= 1.0)


def _raisable(f: Finding) -> Finding:
    """``f``, a link finding held as corroboration only, as one to publish (same id)."""
    evidence = {k: v for k, v in f.evidence.items() if k != CORROBORATES_ONLY}
    return dataclasses.replace(f, evidence_json=evidence_json(evidence))


def _pipeline_pair(top: Finding, pipe: int, ranks: tuple[int, ...],
                   side_ratios: dict[str, float]) -> Finding:
    """The finding of pipeline ``pipe``'s link between the ranks of two sides, from ``top`` (the side with the
    larger impact): its evidence a whole PP group's, with each side's transfer ratio."""
    ev = top.evidence
    # Named, the pair corroborates no more (where both ends only corroborated, each is the other's evidence).
    pair = dataclasses.replace(LinkEvidence.from_dict(ev), group_kind=ParallelGroup.PP, whole_group=True,
                               group=f"{ParallelGroup.PP.value}{pipe}", pp_stage=None,
                               side_transfer_ratio=side_ratios, corroborates_only=False, weak=False)
    # Keys no link evidence has (the impact's) stay as they are.
    evidence = {k: v for k, v in ev.items() if k not in _LINK_KEYS and k != IMPACT_BAR_SHARE} | pair.as_dict()
    return dataclasses.replace(
        top, ranks=ranks, evidence_json=evidence_json(evidence),
        finding_id=finding_id(top.job_id, top.level.value, top.kind.value, ranks, top.phase, top.kernel,
                              top.stream, top.steps))
