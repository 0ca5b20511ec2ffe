"""The link rule: which parallel groups of a job run a collective over a degraded link (pure numerics).

A collective ends together on every member of its group, so each member's time is its waiting for the last
to arrive plus the transfer; the last arrival does not wait, so a group's *fastest* member shows its transfer
time. :func:`detect_links` compares the fastest members of groups of one kind and role (the same pipeline
stage, or the same pair of stages) mode by mode (:mod:`argus.detectors.kernel_modes`); a late peer leaves
that untouched -- waiting is never a link -- while a degraded link slows it on every member. Its results
carry a :class:`LinkEvidence` each, the thresholds are :class:`LinkParams`.

Details and reasoning: docs/links.md.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
from argus.detectors.kernel_modes import mode_quantiles, reference_modes
from argus.detectors.l2_groups import MAD_SCALE
from argus.detectors.link_stats import (
    faster_half,
    floor_outliers,
    group_minima,
    inter_intra,
    late_candidates,
    raised_floors,
)
from argus.detectors.mixture import MixtureBatch
from argus.schemas.records import Finding, ParallelGroup

if TYPE_CHECKING:
    from argus.detectors.l3_kernels import RankScores

__all__ = ["CORROBORATES_ONLY", "IMPACT_BAR_SHARE", "PIPELINE_SIDE", "DegradedLink", "Group", "GroupKind",
           "LinkEvidence", "LinkParams", "PseudoGroup", "corroborates_only", "detect_links", "group_kind"]


class PseudoGroup(enum.Enum):
    """Sets of ranks compared like a parallel group that are none of the topology's
    (:class:`~argus.schemas.records.ParallelGroup`); values as written in a finding's evidence."""

    #: One rank's side of its pipeline transfers (a stream that carries one side only): evidence to pair with
    #: the adjacent stage's side (see :class:`~argus.detectors.link_ledger.LinkLedger`), not a finding on its own.
    PP_SIDE = "PP_SIDE"
    #: Every rank of a job without topology.
    JOB = "JOB"


#: The kind of a set of ranks a collective is read in: a parallel group, or a :class:`PseudoGroup`.
GroupKind = ParallelGroup | PseudoGroup
#: ``group_kind`` in the evidence of a pipeline side's result.
PIPELINE_SIDE = PseudoGroup.PP_SIDE.value
#: Evidence key of a link result that only corroborates another (a result under the impact threshold, or a
#: pipeline side slow by a weaker test than a finding needs): evidence for the job's link ledger, never published.
CORROBORATES_ONLY = "corroborates_only"
#: Evidence key of a link result under the impact threshold (or weak): the share of that threshold its delay
#: reaches. A link slows every collective of its group, and its cost is theirs together (see LinkLedger).
IMPACT_BAR_SHARE = "impact_bar_share"


def group_kind(value: str) -> GroupKind:
    """The :data:`GroupKind` written as ``value`` in evidence; raises :class:`DetectorError` for another."""
    for kinds in (ParallelGroup, PseudoGroup):
        try:
            return kinds(value)
        except ValueError:
            pass
    raise DetectorError(f"unknown group kind {value!r}")


@dataclass(frozen=True)
class LinkParams:
    """Thresholds of the link rule (:func:`detect_links`) and of the job's
    :class:`~argus.detectors.link_ledger.LinkLedger` (defaults in brackets).

    Ratios are of transfer times (a group's fastest member's, read at a mode's middle or low in it) over the
    healthy groups' (the faster half of the groups compared); ``z`` values are robust z-scores of log times.
    Raises :class:`DetectorError` for out-of-range values.
    """

    #: A group this much slower than the others of its kind, and ``z`` above them, is slow [1.3].
    ratio: float = 1.3
    #: Robust z-score (log scale, MAD floored at ``mad_floor``) that a slow group also needs [4.0].
    z: float = 4.0
    #: Beyond this ratio the fastest members wait (in a collective of another kind): no link [20.0].
    max_ratio: float = 20.0
    #: Gate where groups have no spread to judge by (two or three groups, pairs, expert groups, a guessed
    #: grouping with a late arrival): a group of two or three ranks that all wait is slow by their spread of
    #: arrival, commonly x1.5 or more; also of the first and last stages' groups where each stage's one group
    #: is compared across stages (those stages hold the embedding and the output layer) [2.0].
    small_ratio: float = 2.0
    #: Floor of the spread (MAD, log scale) of groups' transfer times: 5 % [0.05].
    mad_floor: float = 0.05
    #: A pipeline side, or a pair of one stage, is slow only where its fastest calls are this much slower
    #: than its peers' too [1.2].
    side_floor_ratio: float = 1.2
    #: Fewest groups compared (or members of each DP/TP group) for a spread to judge by [4].
    spread_set: int = 4
    #: LinkLedger: a transfer this much slower (at the middle or low in the mode) is strong evidence [2.5] ...
    strong_ratio: float = 2.5
    #: ... against this many groups, or as the only slow group of this many in three or more stages [4].
    strong_groups: int = 4
    #: LinkLedger: this many slow groups of a kind in one collective are ranks of one position waiting, no
    #: strong evidence of one group's link [3].
    several_slow: int = 3
    #: A member whose typical call is this many times shorter than its group peers' is the late arrival (the
    #: last to post waits for nobody); a group with one is no reference for transfer times [2.0].
    late_arrival_ratio: float = 2.0
    #: Most spread (largest over smallest) of a group's ratios over its collective's modes that reads as every
    #: bucket slowed alike, where each of two stages' one group is compared with the other's [1.1].
    modes_alike: float = 1.1
    #: Most ratio (larger over smaller) between a pipeline link's two ends' transfer ratios, where each end only
    #: corroborates, for the two to name it together: both ends of one link time the same transfers, while
    #: healthy pipelines' waiting makes sides read slow at unrelated ratios [1.1].
    ends_alike: float = 1.1
    #: Least ratio between two modes of a collective's healthy transfers that makes them two bucket sizes, in
    #: the same comparison [1.5].
    distinct_modes: float = 1.5
    #: Gate of each of two stages' one group (named, 4+ members) in a collective of one size: the stages'
    #: layers are split evenly, and what they hold besides (the embedding, the output layer) moves their
    #: gradients' sizes apart by less [1.5].
    two_stages_ratio: float = 1.5
    #: A pipeline side none of whose peers is slow, itself slowest at its modes' middles (``ratio``), whose
    #: calls at its peers' fastest transfers are this share fewer than theirs (moved up: a slowdown from an
    #: onset inside the window, whose earlier calls keep the side's floor, for most of the window: a healthy
    #: side's fast calls may split into two shapes, a quarter to a third of them apart) corroborates its
    #: neighbour; where the sides' median share of fast calls is under this, none does [0.45].
    moved_share: float = 0.45
    #: Floor of the W1 spread within the sides of ``w1_inter_over_intra_ratio``, as a share of the reference's
    #: mean call (identical ranks on each side have none): the grid's resolution of a W1 score [1e-4].
    w1_resolution: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("ratio", "max_ratio", "small_ratio", "side_floor_ratio", "strong_ratio", "late_arrival_ratio",
                     "modes_alike", "ends_alike", "distinct_modes", "two_stages_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 1.0):
                raise DetectorError(f"{name} must be finite and > 1, got {value}")
        if not (math.isfinite(self.z) and self.z >= 0.0 and 0.0 < self.mad_floor < 1.0):
            raise DetectorError(f"need z >= 0 and mad_floor in (0, 1), got {self.z}, {self.mad_floor}")
        if self.max_ratio <= self.ratio:
            raise DetectorError(f"max_ratio must exceed ratio, got {self.max_ratio} <= {self.ratio}")
        if self.spread_set < 2 or self.strong_groups < 2 or self.several_slow < 2:
            raise DetectorError("need spread_set, strong_groups and several_slow >= 2")
        if not (math.isfinite(self.moved_share) and 0.0 < self.moved_share < 1.0):
            raise DetectorError(f"moved_share must be in (0, 1), got {self.moved_share}")
        if not (math.isfinite(self.w1_resolution) and self.w1_resolution > 0.0):
            raise DetectorError(f"w1_resolution must be finite and > 0, got {self.w1_resolution}")


@dataclass(frozen=True)
class LinkEvidence:
    """The evidence of one ``link_degraded`` result, as :meth:`as_dict` writes it into the finding (keys are
    the field names; units in them). ``group``: kind and index (``TP3``); ``group_index``: a pipeline side's
    or pair's is ``pp_group * 65536 + stage``; ``transfer_ratio`` (= ``p50_ratio``): the group's transfer
    time (``group_min_ns``) over the healthy groups' (``healthy_min_ns``) in the mode holding
    ``mode_share_of_calls`` of the calls, ``low_transfer_ratio`` the same low in the mode;
    ``groups_compared``: groups of its kind and role; ``kind_groups``, ``kind_slow_groups``,
    ``kind_comparisons``: the job's groups of its kind, the slow ones, the comparisons they were judged in.
    ``pp_group``/``pp_stage``: a pipeline side's (``pp_group`` kept by a pair); ``side_transfer_ratio``: a
    pair's sides' ratios by rank. ``corroborates_only``: see :data:`CORROBORATES_ONLY`; ``weak``: the evidence is
    weaker than a finding needs (it corroborates only), not just its impact."""

    group: str
    group_kind: GroupKind
    group_index: int
    whole_group: bool
    transfer_ratio: float
    group_min_ns: float
    low_transfer_ratio: float
    healthy_min_ns: float
    mode_share_of_calls: float
    groups_compared: int
    kind_groups: int
    kind_slow_groups: int
    kind_comparisons: int
    w1_inter_over_intra_ratio: float | None
    window_end_ns: int
    n_ranks: int
    group_known: bool
    collective: bool = True
    pp_group: int | None = None
    pp_stage: int | None = None
    side_transfer_ratio: dict[str, float] | None = None
    corroborates_only: bool = False
    weak: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The evidence dictionary of the finding (unset optional keys left out)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["group_kind"] = self.group_kind.value
        out["p50_ratio"] = self.transfer_ratio
        for key in ("pp_group", "pp_stage", "side_transfer_ratio"):
            if out[key] is None:
                del out[key]
        if not self.corroborates_only:
            del out[CORROBORATES_ONLY]
        if not self.weak:
            del out["weak"]
        return out

    @classmethod
    def from_dict(cls, evidence: dict[str, Any]) -> LinkEvidence:
        """Read a link finding's evidence back; a key it lacks reads as its field's zero (nothing known)."""
        def get(key: str, default: Any) -> Any:
            value = evidence.get(key, default)
            return default if value is None and default is not None else value

        kind = evidence.get("group_kind")
        return cls(
            group=str(get("group", "")), group_kind=group_kind(kind) if kind else ParallelGroup.NONE,
            group_index=int(get("group_index", 0)), whole_group=bool(get("whole_group", False)),
            transfer_ratio=float(get("transfer_ratio", 0.0)), group_min_ns=float(get("group_min_ns", 0.0)),
            low_transfer_ratio=float(get("low_transfer_ratio", 0.0)),
            healthy_min_ns=float(get("healthy_min_ns", 0.0)),
            mode_share_of_calls=float(get("mode_share_of_calls", 0.0)),
            groups_compared=int(get("groups_compared", 0)), kind_groups=int(get("kind_groups", 0)),
            kind_slow_groups=int(get("kind_slow_groups", 0)), kind_comparisons=int(get("kind_comparisons", 0)),
            w1_inter_over_intra_ratio=evidence.get("w1_inter_over_intra_ratio"),
            window_end_ns=int(get("window_end_ns", 0)), n_ranks=int(get("n_ranks", 0)),
            group_known=bool(get("group_known", False)), collective=bool(get("collective", True)),
            pp_group=evidence.get("pp_group"), pp_stage=evidence.get("pp_stage"),
            side_transfer_ratio=evidence.get("side_transfer_ratio"),
            corroborates_only=bool(get(CORROBORATES_ONLY, False)), weak=bool(get("weak", False)))


def corroborates_only(finding: Finding) -> bool:
    """Whether ``finding`` is evidence for the job's link ledger only, never to be published."""
    return CORROBORATES_ONLY in finding.evidence_json and bool(finding.evidence.get(CORROBORATES_ONLY))


F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
#: A set of ranks a collective is read in: (kind, index, its rows among the compared ranks).
Group = tuple[GroupKind, int, I64]
#: Kinds whose groups are compared among few (two or three) or guessed from durations (see ``_Role.few``).
_REDUCING = (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.EP)


@dataclass(frozen=True)
class DegradedLink:
    """One slow group found by :func:`detect_links`: its ``ranks``, its evidence, and ``excess_ns``: its extra
    transfer time over the judged calls (ns, per member)."""

    ranks: tuple[int, ...]
    evidence: LinkEvidence
    excess_ns: float


@dataclass(frozen=True, eq=False)
class _Role:
    """The groups of one kind and role (``stage``: the lowest pipeline stage of its groups, -1 where every
    stage's one group is compared across stages) judged together: per group and mode, ``lg`` (ln of its
    fastest member's time), ``lr``/``lr_low`` (ln ratio to the reference ``ref``, at the modes' middles and
    low in them), ``hit`` (slow there; weak sides included); per group ``slow`` (at any ratio, waiting
    included), ``weak`` (corroboration only) and ``floor_extra`` (ns); ``few``: no spread to judge by."""

    kind: GroupKind
    stage: int
    same: list[tuple[int, I64]]
    lg: F64
    ref: F64
    lr: F64
    lr_low: F64
    hit: Bools
    slow: Bools
    few: bool
    floor_extra: F64
    weak: Bools


@dataclass(frozen=True)
class _Inputs:
    """What every role of one (kernel, stream) is judged on: quantiles ``q``/``q_low`` (ns, ranks x modes, at
    the modes' middles and low in them), each rank's ``typical`` call (ns), its ``floors`` (fastest calls, ns;
    ``floors(True)``: read low inside their cluster), the median ``calls`` per rank, ``group_known`` and each
    rank's pipeline ``stage``; ``below`` (ns, per mode): the reference's calls at the top of the mode below
    (0 for the first mode); ``fast_share(rows, limits)``: each row's share of calls in clusters whose median is
    at most its limit (ns)."""

    q: F64
    q_low: F64
    typical: F64
    floors: Callable[[bool], F64]
    calls: float
    group_known: bool
    stage: I64
    below: F64
    fast_share: Callable[[I64, F64], F64]


def detect_links(ranks: I64, batch: MixtureBatch, sc: RankScores, groups: list[Group], stage: I64, typical: F64,
                 floors: Callable[[bool], F64], explained: Bools, window_end_ns: int, group_known: bool,
                 p: LinkParams, fast_share: Callable[[I64, F64], F64]) -> list[DegradedLink]:
    """Degraded links of one (kernel, stream): groups whose *fastest* member is slow in some mode of the kernel
    against the fastest members of the other groups of their kind and role (module docstring).

    ``ranks``: the compared ranks, ``batch`` their mixtures and ``sc`` their scores (with the collective's
    quantile levels: modes' middles, then low in them); ``groups``: largest first; ``stage``: each rank's
    pipeline stage; ``typical``: each rank's typical call (ns), which tells the groups with a late arrival;
    ``floors``: see :class:`_Inputs`. ``explained``: ranks already explained, updated in place (a group of
    explained ranks is skipped: the smaller groups inside a degraded one). ``group_known``: the trace named
    the stream's group. ``fast_share``: see :class:`_Inputs`.

    A pipeline side (:attr:`PseudoGroup.PP_SIDE`) has no last arrival of its own. Each of its calls ends
    together with the neighbour's, so where this rank posted last its time is the pure transfer: waiting
    lengthens the other calls only, while a degraded link slows every call. A side is therefore slow only if
    its fastest calls (``floors(False)``) are slower than its stage peers' too; a pair's fast calls are read
    at their low quantile (``floors(True)``), so a slowdown from an onset inside the window shows.
    """
    modes = reference_modes(sc.reference, sc.grid)
    # At the modes' middles, and low in each mode: a member's calls hold its waiting wherever another posted
    # last, most of them in a larger group; its fast calls are nearer its transfer.
    q, q_low = np.split(sc.quantiles_ns, 2, axis=1)
    below = np.zeros(len(modes))
    below[1:] = mode_quantiles(sc.reference[None, :], sc.grid, modes.lo[1:] - _BELOW_CUT)[0]
    inputs = _Inputs(q, q_low, typical, floors, float(np.median(batch.counts.sum(axis=1))), group_known, stage,
                     below, fast_share)
    judged = [_judge_role(kind, role_stage, same, inputs, p) for (kind, role_stage), same in _roles(groups, stage)
              if len(same) >= 2]  # one group spans the comparison: nothing to compare its transfer with
    of_kind, slow_stages = _tally(judged)
    out: list[DegradedLink] = []
    for role in judged:
        if 2 * int(role.hit.any(axis=1).sum()) > role.lg.shape[0]:
            continue  # most groups slow: the whole job's network or load, not one group's link
        if role.few and len(slow_stages.get(role.kind, ())) > 1:
            # Two or three groups of a stage have no spread to judge by, only each other, and a guessed grouping
            # may be the wrong one: a slow one is one group's link only where the other stages' groups of its
            # kind are even. Slow groups in several stages (at any ratio) are the ranks of one position
            # waiting in a collective of another kind (the data-parallel replicas that wait for the one a
            # straggler or a stall holds up, seen as their TP groups; the TP members that wait for their
            # partners, seen as DP pairs), or members whose turns at arriving last vary (each member's calls
            # then hold waiting at its median): not a link.
            continue
        base = dataclasses.replace(_EVIDENCE_BASE, window_end_ns=window_end_ns, n_ranks=int(ranks.size),
                                   group_known=group_known, kind_groups=of_kind[role.kind][0],
                                   kind_slow_groups=of_kind[role.kind][1], kind_comparisons=of_kind[role.kind][2])
        out += _role_links(role, ranks, batch, sc, modes.width, inputs.calls, explained, base, p)
    return out


#: Share of the calls below a mode's lower bound at which the reference is read as the top of the mode below.
_BELOW_CUT = 1e-3


#: The fields :func:`_role_links` fills in for each group (placeholders here).
_EVIDENCE_BASE = LinkEvidence(
    group="", group_kind=ParallelGroup.NONE, group_index=0, whole_group=True, transfer_ratio=0.0, group_min_ns=0.0,
    low_transfer_ratio=0.0, healthy_min_ns=0.0, mode_share_of_calls=0.0, groups_compared=0, kind_groups=0,
    kind_slow_groups=0, kind_comparisons=0, w1_inter_over_intra_ratio=None, window_end_ns=0, n_ranks=0,
    group_known=False)


def _role_links(role: _Role, ranks: I64, batch: MixtureBatch, sc: RankScores, widths: F64, calls: float,
                explained: Bools, base: LinkEvidence, p: LinkParams) -> list[DegradedLink]:
    """The slow groups of one role not already explained (``explained`` updated in place), each read at its
    slowest hit mode (``widths``: each mode's share of the calls); ``base``: the evidence they share."""
    out = []
    side = role.kind is PseudoGroup.PP_SIDE
    for i in np.flatnonzero(role.hit.any(axis=1)).tolist():
        g, rows = role.same[i]
        if explained[rows].all():
            continue
        j = int(np.argmax(np.where(role.hit[i], role.lr[i], -np.inf)))
        extra = max(float(np.sum(np.where(role.hit[i], (np.exp(role.lg[i]) - np.exp(role.ref)) * widths * calls,
                                          0.0))), float(role.floor_extra[i]))
        ratio = float(np.exp(role.lr[i, j]))
        explained[rows] |= not role.weak[i]
        evidence = dataclasses.replace(
            base, group=f"{role.kind.value}{g}", group_kind=role.kind, group_index=g, whole_group=not side,
            transfer_ratio=ratio, group_min_ns=float(np.exp(role.lg[i, j])),
            low_transfer_ratio=float(np.exp(role.lr_low[i, j])), healthy_min_ns=float(np.exp(role.ref[j])),
            mode_share_of_calls=float(widths[j]), groups_compared=role.lg.shape[0],
            w1_inter_over_intra_ratio=inter_intra(batch, sc, rows, np.flatnonzero(~explained), p.w1_resolution),
            pp_group=g // 65536 if side else None, pp_stage=g % 65536 if side else None,
            corroborates_only=bool(role.weak[i]), weak=bool(role.weak[i]))
        out.append(DegradedLink(tuple(sorted(int(r) for r in ranks[rows])), evidence, extra))
    return out


def _roles(groups: list[Group], stage: I64) -> list[tuple[tuple[GroupKind, int], list[tuple[int, I64]]]]:
    """The groups by kind *and role*: the same pipeline stage (the first and last stages hold the embedding
    and the output layer, so their DP collectives move other sizes), for a pipeline pair the same pair of
    stages; across stages (role -1) where each stage has one group of the kind."""
    roles: dict[tuple[GroupKind, int], list[tuple[int, I64]]] = {}
    for kind, g, rows in groups:
        roles.setdefault((kind, int(stage[rows].min())), []).append((g, rows))
    for kind in dict.fromkeys(k for k, _ in roles):  # one group per stage: the stages' groups are all there is
        if all(len(v) < 2 for (k, _), v in roles.items() if k is kind):
            pooled = [grp for (k, _), v in roles.items() if k is kind for grp in v]
            for key in [key for key in roles if key[0] is kind]:
                del roles[key]
            roles[(kind, -1)] = pooled
    return list(roles.items())


def _tally(judged: list[_Role]) -> tuple[dict[GroupKind, list[int]], dict[GroupKind, set[int]]]:
    """Of every group of a kind in the job, how many were compared, how many are slow and in how many
    comparisons ([groups, slow, comparisons] per kind), and the roles with a slow group per kind: one slow
    group among many even ones (each stage's groups compared among themselves) is one group's link, where
    waiting in a collective of another kind would slow the same position in every stage's groups."""
    of_kind: dict[GroupKind, list[int]] = {}
    slow_stages: dict[GroupKind, set[int]] = {}
    for role in judged:
        tally = of_kind.setdefault(role.kind, [0, 0, 0])
        tally[0] += len(role.same)
        tally[1] += int(role.slow.sum())
        tally[2] += 1
        if role.slow.any():
            slow_stages.setdefault(role.kind, set()).add(role.stage)
    return of_kind, slow_stages


def _judge_role(kind: GroupKind, role_stage: int, same: list[tuple[int, I64]], inputs: _Inputs,
                p: LinkParams) -> _Role:
    """The groups of one kind and role against the faster half of them (see :class:`_Role`)."""
    # A group with a late arrival is no reference: its fastest member (the late one) never waits, while
    # another group's fastest member waits in the calls where a peer posted last.
    # Without two such groups nothing is named, but the slow groups still count as the kind's (_tally). Nor
    # where they are fewer than the groups with one: one position then arrives late in most groups (the
    # replica a straggler holds up), and the groups where it does not show are those whose members' turns at
    # arriving last vary, each member's calls holding waiting at its middle.
    late = _with_late_arrival(kind, same, inputs.typical, p.late_arrival_ratio)
    no_reference = late.any() and int((~late).sum()) < max(2, int(late.sum()))
    # Unless every late group's late member holds one position (one replica behind in every group, its members
    # the last to arrive): then a group whose fastest member holds it too reads that member's transfer, late
    # by less where its link is slow (its own transfer lengthens every member's calls), and compares with the
    # late groups' fastest members.
    at_late = (_at_one_late_position(same, inputs.typical, late) if no_reference
               else np.ones(len(same), dtype=bool))
    ref_rows = ~late if not no_reference else np.ones(late.size, dtype=bool)
    lg = np.log(group_minima(inputs.q, [rows for _, rows in same]))
    n = lg.shape[0]
    ref = faster_half(lg[ref_rows])
    low = np.log(group_minima(inputs.q_low, [rows for _, rows in same]))
    lr_low = low - faster_half(low[ref_rows])
    # Two or three groups of one stage (reductions, gathers, all-to-alls), with no spread to judge by, or
    # any number in a grouping guessed from durations: see the several-stages rule in detect_links.
    few = role_stage >= 0 and kind in _REDUCING and (n < p.spread_set or not inputs.group_known)
    lr, hit, weak_hits = _hits(kind, role_stage, same, lg, lg - ref, lr_low, late, inputs, p)
    if n >= p.spread_set:
        # Of many groups, a mode whose reference transfer (the healthy groups' fastest members) lies in a mode
        # below holds the waiting of members that are never the last to arrive (an all-to-all's members that
        # finish their experts first): the fastest members have no calls there, and their reading is the
        # tail of a faster mode, which compares nothing. (Of two or three groups, a slow one moves the modes.)
        hit &= (ref > np.log(np.maximum(inputs.below, 1.0)))[None, :]
    floor_extra = np.zeros(n)
    side_rows = np.array([rows[0] for _, rows in same])  # a pipeline side is one rank
    side_floors = inputs.floors(False)[side_rows] if kind is PseudoGroup.PP_SIDE else None
    if side_floors is not None and n >= p.spread_set:
        # A side's fastest calls are its pure transfers, which waiting leaves alone, while its typical ones
        # hold waiting (a bubble, a slow stage): where its stage peers' typical calls wait much, a side
        # slower in every transfer stands out in its fastest calls only, so those alone can name it.
        by_floor, floor_lr, floor_extra = floor_outliers(side_floors, inputs.calls, p)
        lr = np.where(by_floor[:, None], np.maximum(lr, floor_lr[:, None]), lr)
        hit |= by_floor[:, None]
    slow: Bools = np.asarray(hit.any(axis=1))  # slow at any ratio, waiting included
    hit[~at_late] = False
    # Beyond a plausible slowdown of a transfer it is waiting: a group made only of ranks that wait in a
    # collective of another kind (all of one TP index, waiting for the others) looks "slow" by far more.
    hit &= lr <= math.log(p.max_ratio)
    weak = weak_hits & (lr.max(axis=1) <= math.log(p.max_ratio)) & at_late
    if side_floors is not None:
        hit, weak = _side_gates(hit, lr, side_floors, inputs.floors(True)[side_rows], p)
        if not (hit.any() or weak.any()):
            limits = np.full(n, np.nanmedian(side_floors) * p.ratio)
            weak = _moved_side(lr, side_floors, inputs.fast_share(side_rows, limits), p)
    return _Role(kind, role_stage, same, lg, ref, lr, lr_low, hit | weak[:, None], slow, few, floor_extra, weak)


def _hits(kind: GroupKind, role_stage: int, same: list[tuple[int, I64]], lg: F64, lr: F64, lr_low: F64,
          late: Bools, inputs: _Inputs, p: LinkParams) -> tuple[F64, Bools, Bools]:
    """The log ratios the groups are judged by, which (group, mode) are slow and which groups are slow by
    evidence that only corroborates, by how many groups there are to compare and of what kind."""
    n = lg.shape[0]
    none = np.zeros(n, dtype=bool)
    if n >= p.spread_set:
        mad = MAD_SCALE * np.median(np.abs(lg - np.median(lg, axis=0)), axis=0)
        gate = np.full((n, 1), math.log(p.ratio))
        if role_stage < 0:
            # Each stage's one group, compared across stages: the first and last stages also hold the embedding
            # and the output layer (their collectives move other sizes, at another point of the schedule), so
            # their groups, unlike the middle stages', differ by more than a plain slow link.
            at = np.array([int(inputs.stage[rows].min()) for _, rows in same])
            gate[(at == at.min()) | (at == at.max())] = math.log(max(p.ratio, p.small_ratio))
        return lr, (lr >= gate) & (lr >= p.z * np.maximum(mad, p.mad_floor)), none
    if (kind in (ParallelGroup.DP, ParallelGroup.TP) and role_stage >= 0
            and min(rows.size for _, rows in same) >= p.spread_set):
        # Reductions of groups of 4+ members each, in one stage (stages move other sizes): a reduction ends
        # together on every member, so each group's fastest member is its last arrival, a pure transfer
        # however its members arrived, and two or three groups compare like many. (An all-to-all is sends
        # and receives: a member's part ends on its own.) Where the trace did not name the group, the
        # grouping is one guess of several, which LinkLedger has confirmed by a second collective; where
        # one of the groups has a late arrival (no reference, above), such a guess must be x2 slower.
        plain = inputs.group_known or not late.any()
        return lr, lr >= math.log(p.ratio if plain else max(p.ratio, p.small_ratio)), none
    if (n == 2 and role_stage < 0 and kind in (ParallelGroup.DP, ParallelGroup.TP) and inputs.group_known
            and min(rows.size for _, rows in same) >= p.spread_set):
        # Two stages' groups, one each, of 4+ members named by the trace: the stages hold other layers (the
        # embedding, the output layer), so their collectives move other sizes, but a collective in buckets moves
        # buckets of one size (and a remainder): other sizes move some of its modes, a slow link every one
        # alike. A group slower in two or more distinct modes (the reference's transfers ``distinct_modes``
        # apart) by a like ratio is slow at the plain one; otherwise (one mode: a slow link and another size
        # read alike) at ``two_stages_ratio``, more than two stages' sizes differ by, and between the two it
        # only corroborates (and adds its cost to) a group another collective names.
        ref = lg[0] - lr[0]
        low, high = lr.min(axis=1), lr.max(axis=1)
        alike = ((float(np.ptp(ref)) >= math.log(p.distinct_modes)) & (low >= math.log(p.ratio))
                 & (high - low <= math.log(p.modes_alike)))
        hit = np.where(alike[:, None], lr >= math.log(p.ratio), lr >= math.log(max(p.ratio, p.two_stages_ratio)))
        weak: Bools = np.asarray((lr >= math.log(p.ratio)).any(axis=1) & ~hit.any(axis=1), dtype=bool)
        return lr, hit, weak
    if kind is not PseudoGroup.PP_SIDE:
        # Read low in the mode too (a side's fast calls are its floors' to judge): a group slow in every
        # call is slower there than at the middle, where the other groups' calls hold waiting.
        lr = np.maximum(lr, lr_low)
    hit = lr >= math.log(max(p.ratio, p.small_ratio))
    if kind is not PseudoGroup.PP_SIDE and role_stage >= 0 and all(rows.size == 2 for _, rows in same):
        # Two or three pairs of one stage (which move the same sizes) have no spread of transfers to
        # judge by. Waiting lengthens some calls of a pair and leaves each member's fast calls (where
        # it arrived last: about half of them, unless its peer is a straggler) as fast as the other
        # pairs', while a degraded link slows every call: a pair whose members' fast calls are both
        # slower too is slow at the plain link ratio. (A member of a larger group arrives last in
        # too few calls for its fast ones to be transfers alone.) Read at their low quantile inside
        # their cluster: a slowdown from an onset inside the window leaves the old shortest call.
        raised = raised_floors(np.array([inputs.floors(True)[rows].min() for _, rows in same]),
                               p.side_floor_ratio)
        if raised is not None:
            hit |= (lr >= math.log(p.ratio)) & raised[:, None]
    return lr, hit, none


def _side_gates(hit: Bools, lr: F64, floors: F64, within: F64, p: LinkParams) -> tuple[Bools, Bools]:
    """Pipeline sides: ``hit`` kept only where a side's fastest calls (``floors``, ns) are slower than its
    peers' too (a side without a floor, NaN, is no link), and which sides corroborate only (``weak``): where
    none is slow, the slowest at the modes' middles, short of the z-score, whose fast calls read inside their
    cluster (``within``, ns) are slower too (a slowdown from an onset inside the window shares a cluster with
    the old fast calls): no link on its own, but corroboration of its neighbour's side, which a degraded link
    slows too. Of two or three sides (no z-score to judge their modes by), the one side whose fast calls are
    slower both ways (``floors`` and ``within``) corroborates so, whatever its modes show."""
    weak = np.zeros(lr.shape[0], dtype=bool)
    raised = raised_floors(floors, p.side_floor_ratio)
    if raised is not None:
        hit &= raised[:, None]
    inside = raised_floors(within, p.side_floor_ratio)
    if inside is None or hit.any():
        return hit, weak
    if lr.shape[0] >= p.spread_set:
        top = np.where(lr <= math.log(p.max_ratio), lr, -np.inf).max(axis=1)
        weak = inside & (top >= math.log(p.ratio)) & (top == top.max())
    elif raised is not None and int((raised & inside).sum()) == 1:
        # Two or three pipelines: a side's typical calls may hold more waiting than its peers' or less (its
        # neighbour is slower or faster to post), so its modes hide a slower transfer. Its fast calls do not:
        # the only side slower there, read either way, corroborates its neighbour's side.
        weak = raised & inside
    return hit, weak


def _moved_side(lr: F64, floors: F64, fast: F64, p: LinkParams) -> Bools:
    """Pipeline sides: which corroborates by its moved calls -- of sides none slow (``lr``: ln ratios at the
    modes' middles; ``floors``: fastest calls, ns), the one slowest at the middles, at least ``ratio``, whose
    share of calls at its peers' fastest transfers (``fast``) is ``moved_share`` under the sides' median. A
    slowdown from an onset inside the window moves the later calls up as a cluster of their own and leaves the
    earlier ones, and so the side's floor, where they were."""
    none = np.zeros(lr.shape[0], dtype=bool)
    known = np.isfinite(fast) & np.isfinite(floors)
    if int(known.sum()) < p.spread_set:
        return none
    typical = float(np.median(fast[known]))
    if typical < p.moved_share:
        return none  # the sides' calls are mostly waiting: too few fast ones to tell how many moved
    moved = 1.0 - fast / typical
    top = np.where(lr <= math.log(p.max_ratio), lr, -np.inf).max(axis=1)
    slowest = known & (top >= math.log(p.ratio)) & (top == top[known].max())
    return np.asarray(slowest & (moved >= p.moved_share), dtype=bool)


def _at_one_late_position(same: list[tuple[int, I64]], typical: F64, late: Bools) -> Bools:
    """Per group of ``same``: whether its fastest member (by ``typical``) holds the position (index among its
    rows) that every late group's fastest member holds; all False where the late groups' positions differ."""
    fastest = np.array([int(np.argmin(typical[rows])) for _, rows in same], dtype=np.int64)
    positions = np.unique(fastest[late])
    if positions.size != 1:
        return np.zeros(len(same), dtype=bool)
    return np.asarray(fastest == positions[0])


def _with_late_arrival(kind: GroupKind, same: list[tuple[int, I64]], typical: F64, ratio: float) -> Bools:
    """Per group of ``same`` (index, rows), whether a member is a late arrival by :func:`late_candidates`
    (``typical``: each row's typical call, ns; ``ratio``: the late arrival's); a pipeline side (one rank) never
    has one."""
    late = np.zeros(len(same), dtype=bool)
    if kind is PseudoGroup.PP_SIDE:
        return late
    at = {g: i for i, (g, _) in enumerate(same)}
    for size in {rows.size for _, rows in same}:
        for c in late_candidates([(kind, g, rows) for g, rows in same if rows.size == size], typical, ratio):
            late[at[c[2]]] = True
    return late
