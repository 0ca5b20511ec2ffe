"""Which ranks' collective calls end together: the parallel group a collective stream serves, from times alone.

A collective ends together on every member of its group -- each member's kernel starts when the member
arrives and ends when the last one has arrived and the transfer is done -- and NCCL runs one communicator's
collectives in the same order on every member. So for two ranks on one stream, the ``i``-th calls of both:

* members of one group: their *end* offsets (``end_q - end_r``) stay constant -- the clocks' offset, its slow
  drift, and the few µs of the ring's last hops -- while their *start* offsets vary with who arrived when;
* ranks of different groups: each group ends at its own last arrival, so their end offsets vary about as
  much as their start offsets.

Details and reasoning: docs/internals/detectors.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
from argus.schemas.records import JobTopology, ParallelGroup

__all__ = ["CoEndParams", "KindPairs", "StreamCalls", "co_ending_kinds", "kind_pairs", "pair_ratio",
           "pair_spreads", "sampled_ranks", "stream_kind"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
#: The kinds a stream may be named, in the order a tie between kinds with the very same groups is decided:
#: the reductions' and the all-to-all's. A pipeline's transfers are pairs of adjacent stages on a stream per
#: side (the diagnosis reads them so, as :attr:`~argus.detectors.links.PseudoGroup.PP_SIDE`), whose calls
#: follow each other down the pipeline closely enough to look half co-ended: never named from times.
KINDS = (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.EP)
#: Every kind whose groups may hold a larger group a stream's collectives run in (``outside`` pairs).
_ALL_KINDS = (*KINDS, ParallelGroup.PP)


@dataclass(frozen=True)
class StreamCalls:
    """One rank's collective calls on one stream, in start order: ``start_ns``, ``end_ns``, ``step`` (-1 where
    outside every step) and ``name`` (an id of the kernel's name, the same on every rank), equal lengths."""

    start_ns: I64
    end_ns: I64
    step: I64
    name: I64

    def __post_init__(self) -> None:
        n = self.start_ns.shape[0]
        if any(a.shape != (n,) for a in (self.end_ns, self.step, self.name)):
            raise DetectorError("StreamCalls: start_ns, end_ns, step and name must be 1-d arrays of one length")

    def __len__(self) -> int:
        return int(self.start_ns.shape[0])


@dataclass(frozen=True)
class CoEndParams:
    """Gates of the co-ending test (defaults in brackets). Raises :class:`DetectorError` for out-of-range
    values."""

    #: A pair co-ends where its end offsets spread at most this fraction of its start offsets' spread [0.25]:
    #: the ring's last hops (µs) against arrivals that differ by the noise of the compute between calls.
    #: Ranks of two groups end each at its own last arrival, so theirs spread about as much as their starts
    #: (ratio near 1; about 1/2 where both groups are large, the last of many arrivals varying less).
    ratio: float = 0.25
    #: Fewest calls of a pair matched one to one to judge it by [8].
    min_calls: int = 8
    #: The calls of a pair are matched with up to this many calls' shift (a trace cut mid-step on one rank) [2].
    max_shift: int = 2
    #: Share of matched calls of one kernel name on both ranks; fewer: not the same collectives [0.9].
    same_names: float = 0.9
    #: Groups sampled per kind, and members of each paired with its first [6, 3].
    groups: int = 6
    members: int = 3
    #: A kind is the stream's where this share of its member pairs co-end [0.9] and at most this share of
    #: its pairs beyond its groups do [0.1] ...
    inside: float = 0.9
    outside: float = 0.1
    #: ... a pair beyond co-ending where its end offsets spread at most this many times the members' [4.0],
    #: a spread floored at the traces' resolution (Kineto writes µs; some tools whole ones) [1000 ns].
    beyond: float = 4.0
    resolution_ns: float = 1000.0

    def __post_init__(self) -> None:
        if not (0.0 < self.ratio < 1.0 and 0.5 <= self.same_names <= 1.0):
            raise DetectorError(f"need ratio in (0, 1) and same_names in [0.5, 1], got {self.ratio}, "
                                f"{self.same_names}")
        if not (0.5 < self.inside <= 1.0 and 0.0 <= self.outside < 0.5):
            raise DetectorError(f"need inside in (0.5, 1] and outside in [0, 0.5), got {self.inside}, {self.outside}")
        if not (self.beyond >= 1.0 and self.resolution_ns > 0.0):
            raise DetectorError(f"need beyond >= 1 and resolution_ns > 0, got {self.beyond}, {self.resolution_ns}")
        if self.min_calls < 3 or self.max_shift < 0 or self.groups < 2 or self.members < 1:
            raise DetectorError("need min_calls >= 3, max_shift >= 0, groups >= 2, members >= 1")


def _spread(x: F64, t: F64) -> float:
    """Median absolute deviation of ``x`` around its least-squares line in ``t`` (a clock's drift)."""
    if x.size >= 3 and np.ptp(t) > 0:
        slope, icpt = np.polyfit(t, x, 1)
        x = x - (slope * t + icpt)
    return float(np.median(np.abs(x - np.median(x))))


def _in_common_steps(a: StreamCalls, b: StreamCalls) -> tuple[StreamCalls, StreamCalls]:
    """Both ranks' calls in the steps both traced (all of them where either has no call in a step: a trace
    without step annotations)."""
    if not ((a.step >= 0).any() and (b.step >= 0).any()):
        return a, b
    both = np.intersect1d(a.step[a.step >= 0], b.step[b.step >= 0])

    def keep(c: StreamCalls) -> StreamCalls:
        m = np.isin(c.step, both)
        return StreamCalls(c.start_ns[m], c.end_ns[m], c.step[m], c.name[m])

    return keep(a), keep(b)


def pair_spreads(a: StreamCalls, b: StreamCalls, p: CoEndParams) -> tuple[float, float] | None:
    """The spreads (ns) of two ranks' end offsets and of their start offsets (see the module docstring), at
    the alignment of their calls (shifted by up to ``p.max_shift``) where the end offsets spread least; None
    where they cannot be compared: fewer than ``p.min_calls`` matched calls, or other kernels
    (``p.same_names``)."""
    a, b = _in_common_steps(a, b)
    best: tuple[float, float] | None = None
    for k in range(-p.max_shift, p.max_shift + 1):
        lo_a, lo_b = max(0, -k), max(0, k)
        n = min(len(a) - lo_a, len(b) - lo_b)
        if n < p.min_calls:
            continue
        sa, sb = slice(lo_a, lo_a + n), slice(lo_b, lo_b + n)
        if float(np.mean(a.name[sa] == b.name[sb])) < p.same_names:
            continue
        t = (a.end_ns[sa] - a.end_ns[lo_a]).astype(np.float64)
        end = _spread((b.end_ns[sb] - a.end_ns[sa]).astype(np.float64), t)
        if best is None or end < best[0]:
            best = (end, _spread((b.start_ns[sb] - a.start_ns[sa]).astype(np.float64), t))
    return best


def _co_ends(spreads: tuple[float, float], p: CoEndParams) -> bool:
    """Whether a pair's (end, start) offset spreads (ns) are those of a pair that co-ends (``p.ratio``)."""
    return spreads[1] > 0.0 and spreads[0] <= p.ratio * spreads[1]


def _resolves(spreads: tuple[float, float] | None, p: CoEndParams) -> bool:
    """Whether a pair's start offsets spread enough for co-ending to show: its ends must spread under
    ``p.ratio`` of its starts, which below the traces' resolution (``p.resolution_ns``) no timestamp can
    show. Pairs that arrive together (a data-parallel pair after the same layers) tell nothing either way.
    Pairs that cannot be compared (None) are kept: they count against a kind."""
    return spreads is None or p.ratio * spreads[1] >= p.resolution_ns


def pair_ratio(a: StreamCalls, b: StreamCalls, p: CoEndParams) -> float | None:
    """Of :func:`pair_spreads`, the end offsets' spread over the start offsets' (a small ratio: the pair
    co-ends); None where they cannot be compared or the start offsets do not spread at all."""
    spreads = pair_spreads(a, b, p)
    if spreads is None or spreads[1] <= 0.0:
        return None
    return spreads[0] / spreads[1]


@dataclass(frozen=True)
class KindPairs:
    """The rank pairs a kind is judged by: ``inside`` (members of one of its groups) and ``outside`` (a member
    with a rank of another of its groups, or of the member's group of another kind, not in its own)."""

    kind: ParallelGroup
    inside: tuple[tuple[int, int], ...]
    outside: tuple[tuple[int, int], ...]
    #: The kind's groups, each rank's labelled by the order of the groups' first ranks (equal for kinds with
    #: the very same groups, which cannot be told apart).
    partition: bytes


def _spaced(n: int, k: int) -> list[int]:
    """Up to ``k`` of ``range(n)``, evenly spaced, first and last included."""
    return sorted({round(x) for x in np.linspace(0, n - 1, min(n, k))}) if n else []


def _labels(column: I64) -> bytes:
    """A partition of ranks (``column``: each rank's group id) as each rank's group numbered in the order of
    the groups' first ranks: equal for two columns exactly where their groups are the same sets."""
    _, first, inverse = np.unique(column, return_index=True, return_inverse=True)
    order: I64 = np.argsort(np.argsort(first, kind="stable"), kind="stable")
    return bytes(order[inverse].astype(np.int64).tobytes())


def kind_pairs(topology: JobTopology, p: CoEndParams) -> list[KindPairs]:
    """For each kind of :data:`KINDS` with groups of 2+ ranks in ``topology``, the pairs it is judged by (up
    to ``p.groups`` groups, evenly spaced, each with up to ``p.members`` members; outside pairs with a member
    of another group of the kind and of its groups of every other kind); deterministic."""
    ranks = topology.array("rank")
    columns = {k: topology.array(k.column) for k in _ALL_KINDS}
    out = []
    for kind in KINDS:
        col = columns[kind]
        ids, counts = np.unique(col, return_counts=True)
        ids = ids[counts >= 2]
        if not ids.size:
            continue
        members = {int(g): ranks[col == g] for g in ids[_spaced(ids.size, p.groups)]}
        inside, outside = [], []
        groups = list(members.values())
        for i, g in enumerate(groups):
            lead = int(g[0])
            inside += [(lead, int(g[j])) for j in _spaced(g.size, p.members + 1) if j]
            outside.append((lead, int(groups[(i + 1) % len(groups)][0])) if len(groups) > 1 else (lead, lead))
            pos = int(np.flatnonzero(ranks == lead)[0])
            for other in _ALL_KINDS:
                if other is kind:
                    continue
                peers = ranks[(columns[other] == columns[other][pos]) & (col != col[pos])]
                if peers.size:
                    outside.append((lead, int(peers[0])))
        out.append(KindPairs(kind, tuple(inside), tuple((a, b) for a, b in outside if a != b), _labels(col)))
    return out


def sampled_ranks(pairs: Sequence[KindPairs]) -> set[int]:
    """Every rank some pair of ``pairs`` reads (only their calls need be read from the traces)."""
    return {r for kp in pairs for pair in (*kp.inside, *kp.outside) for r in pair}


def stream_kind(calls: Mapping[int, StreamCalls], pairs: Sequence[KindPairs], p: CoEndParams) -> ParallelGroup:
    """The kind of the group one stream's collectives run in (``calls``: per rank, its calls on the stream),
    or NONE where no kind, or more than one with different groups, co-ends inside and not beyond.

    A pair co-ends by its own arrivals: its end offsets spread at most ``p.ratio`` of its start offsets.
    Beyond, a pair co-ends only *as the members do* too: its end offsets spread no more than ``p.beyond``
    times the members' (their median, floored at ``p.resolution_ns``). The ratio alone does not tell: two
    groups that both end at a common point (the step's last bucket) after arrivals that differ much
    between them (a pipeline's stages) have a small ratio, yet end tens of µs apart, where the members of
    one collective end within its last hops; and two groups that start together end together without
    telling anything."""
    cache: dict[tuple[int, int], tuple[float, float] | None] = {}

    def spreads(pair: tuple[int, int]) -> tuple[float, float] | None:
        if pair not in cache:
            a, b = calls.get(pair[0]), calls.get(pair[1])
            cache[pair] = None if a is None or b is None else pair_spreads(a, b, p)
        return cache[pair]

    found: list[KindPairs] = []
    for kp in pairs:
        # Pairs whose starts spread under the resolution are left out of both counts (_resolves); at least
        # half the sampled pairs must be judged.
        inside = [x for x in (spreads(pair) for pair in kp.inside) if _resolves(x, p)]
        ends = [x[0] for x in inside if x is not None and _co_ends(x, p)]
        if not inside or len(inside) < len(kp.inside) / 2 or len(ends) < p.inside * len(inside):
            continue  # pairs that cannot be compared count against: the stream need not run this kind at all
        level = p.beyond * max(float(np.median(ends)), p.resolution_ns)
        outside = [_co_ends(x, p) and x[0] <= level for x in (spreads(pair) for pair in kp.outside)
                   if x is not None and _resolves(x, p)]
        if sum(outside) > p.outside * len(outside):
            continue  # the group reaches beyond this kind's: a larger one that contains it
        found.append(kp)
    if not found or any(kp.partition != found[0].partition for kp in found[1:]):
        return ParallelGroup.NONE
    return found[0].kind


def co_ending_kinds(calls: Mapping[int, Mapping[int, StreamCalls]], topology: JobTopology,
                    p: CoEndParams | None = None) -> dict[int, ParallelGroup]:
    """Per stream of ``calls`` (stream -> rank -> its calls), the kind of group its collectives run in, where
    :func:`stream_kind` names one."""
    params = p if p is not None else CoEndParams()
    pairs = kind_pairs(topology, params)
    out: dict[int, ParallelGroup] = {}
    for stream, by_rank in sorted(calls.items()):
        kind = stream_kind(by_rank, pairs, params)
        if kind is not ParallelGroup.NONE:
            out[stream] = kind
    return out
