"""PhaseTable.from_batches (layouts summed for many batches at once, overlaps by coverage in int64) against a
plain per-batch, per-phase re-statement of what it computes (issue 10)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.detectors.l2_phases import BLOCKING_GROUPS, PhaseTable
from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind

PROPERTY = settings(max_examples=80, deadline=None)
COMPUTE = {PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER}
KINDS = [PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER, PhaseKind.ALL_REDUCE, PhaseKind.SEND_RECV,
         PhaseKind.DATA_LOADER, PhaseKind.ALL_TO_ALL, PhaseKind.OTHER]
GROUPS = [ParallelGroup.TP, ParallelGroup.DP, ParallelGroup.PP, ParallelGroup.EP, ParallelGroup.NONE]


def reference(batches: list[PhaseBatch]) -> dict[str, list]:
    """Rows of the table, phase by phase: the last batch of each (rank, step) in order of first arrival, its
    phase ids in ascending order; a compute phase's nested time is the sum of its pairwise overlaps with the
    batch's blocking collectives, capped at its duration (none when the batch has no blocking collective)."""
    latest: dict[tuple[int, int], PhaseBatch] = {}
    for b in batches:
        latest[(b.rank, b.step)] = b
    keys: dict[tuple[str, PhaseKind, ParallelGroup], int] = {}
    rows: dict[str, list] = {"rank": [], "step": [], "phase": [], "duration": [], "count": [], "nested": []}
    for (rank, step), b in latest.items():
        ids = [keys.setdefault(k, len(keys)) for k in zip(b.names, b.kinds, b.groups, strict=True)]
        blocks = [i for i, (k, g) in enumerate(zip(b.kinds, b.groups, strict=True))
                  if k.is_collective and g in BLOCKING_GROUPS]
        nested = [0] * len(ids)
        for i, k in enumerate(b.kinds):
            if k in COMPUTE and blocks:
                s, e = b.start_ns[i], b.start_ns[i] + b.duration_ns[i]
                over = sum(max(0, min(e, b.start_ns[c] + b.duration_ns[c]) - max(s, b.start_ns[c])) for c in blocks)
                nested[i] = min(over, b.duration_ns[i])
        for pid in sorted(set(ids)):
            cols = [i for i, x in enumerate(ids) if x == pid]
            rows["rank"].append(rank)
            rows["step"].append(step)
            rows["phase"].append(pid)
            rows["duration"].append(sum(b.duration_ns[i] for i in cols))
            rows["count"].append(len(cols))
            rows["nested"].append(sum(nested[i] for i in cols))
    rows["names"] = [k[0] for k in keys]
    rows["kinds"] = [k[1] for k in keys]
    rows["groups"] = [k[2] for k in keys]
    return rows


def _as_rows(t: PhaseTable) -> dict[str, list]:
    return {"rank": t.rank.tolist(), "step": t.step.tolist(), "phase": t.phase.tolist(),
            "duration": t.duration_ns.tolist(), "count": t.count.tolist(),
            "nested": (t.nested_ns if t.nested_ns is not None else np.zeros(0, dtype=np.int64)).tolist(),
            "names": list(t.names), "kinds": list(t.kinds), "groups": list(t.groups)}


def _batches(seed: int) -> list[PhaseBatch]:
    """A few layouts (repeated names, several blocking collectives, overlaps in any arrangement, zero
    durations), epoch-scale starts, ranks and steps delivered twice or out of order."""
    rng = np.random.default_rng(seed)
    layouts = []
    for _ in range(int(rng.integers(1, 5))):
        width = int(rng.integers(1, 12))
        layouts.append(([f"p{int(rng.integers(0, 6))}" for _ in range(width)],
                        [KINDS[int(i)] for i in rng.integers(0, len(KINDS), width)],
                        [GROUPS[int(i)] for i in rng.integers(0, len(GROUPS), width)]))
    out = []
    for _ in range(int(rng.integers(0, 40))):
        names, kinds, groups = layouts[int(rng.integers(0, len(layouts)))]
        t0 = int(rng.integers(0, 2)) * 1_700_000_000_000_000_000 + int(rng.integers(0, 10**12))
        start = (t0 + rng.integers(0, rng.choice([100, 10**6, 10**9]), len(names))).tolist()
        dur = rng.integers(0, rng.choice([1, 50, 10**6, 10**9]), len(names))
        dur[rng.random(len(names)) < 0.1] = 0
        out.append(PhaseBatch("j", int(rng.integers(0, 6)), int(rng.integers(0, 4)), tuple(kinds), tuple(names),
                              tuple(groups), tuple(0 for _ in names), tuple(start), tuple(dur.tolist())))
    return out


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1))
def test_from_batches_matches_the_per_phase_reference(seed: int) -> None:
    batches = _batches(seed)
    assert _as_rows(PhaseTable.from_batches(batches)) == reference(batches)


def test_from_batches_nesting_cases() -> None:
    tp, fwd = (PhaseKind.ALL_REDUCE, ParallelGroup.TP), (PhaseKind.FORWARD, ParallelGroup.NONE)
    cases = [
        [fwd, tp, tp],  # two collectives inside one phase
        [tp, fwd, tp, fwd],  # collectives straddling phase edges
        [fwd, fwd],  # nothing nests
        [tp],  # a collective alone
    ]
    for layout in cases:
        for starts, durs in [((0, 10, 15, 30)[: len(layout)], (40, 10, 30, 5)[: len(layout)]),
                             ((5, 0, 5, 5)[: len(layout)], (0, 100, 0, 3)[: len(layout)]),
                             ((10**18, 10**18 + 1, 10**18 + 1, 10**18)[: len(layout)], (1, 1, 1, 1)[: len(layout)])]:
            b = PhaseBatch("j", 0, 0, tuple(k for k, _ in layout), tuple(f"n{i}" for i in range(len(layout))),
                           tuple(g for _, g in layout), (0,) * len(layout), tuple(starts), tuple(durs))
            assert _as_rows(PhaseTable.from_batches([b, b])) == reference([b])


def test_from_batches_of_nothing() -> None:
    t = PhaseTable.from_batches([])
    assert len(t) == 0 and t.names == () and t.nested_ns is not None and t.nested_ns.size == 0
