"""MoE expert kernels: their work is the tokens the router sends them, which differ between ranks.

In a mixture-of-experts layer with expert parallelism, each rank's grouped GEMMs run its own experts on the
tokens routed to them. A hot expert (the router favours it) gets more tokens, so its rank's grouped GEMMs
run longer without anything being wrong with the rank; a slow GPU runs them longer on the same tokens. The
L3 comparisons of a kernel across ranks assume the same work on every rank, which grouped GEMMs do not do.
They are read here per routed token where the trace counts tokens, else on expert-parallel group
means: docs/moe.md ("What the diagnosis does now").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from argus.schemas.records import JobTopology

__all__ = ["GROUPED_GEMM_MARKERS", "ep_group_ids", "group_means", "hot_experts", "is_grouped_gemm",
           "per_token_scale", "repeated_expert"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Lower-case substrings of grouped-GEMM kernel names: CUTLASS 3 grouped problem shapes (Hopper, Transformer
#: Engine and torch._grouped_mm), CUTLASS 2 ``GemmGrouped`` (the ``grouped_gemm`` package on Ampere), and
#: kernels named after the op.
GROUPED_GEMM_MARKERS = ("groupproblemshape", "gemmgrouped", "grouped_gemm", "groupedgemm", "grouped_mm",
                        "grouped_matmul")


def is_grouped_gemm(kernel: str) -> bool:
    """Whether ``kernel`` names a grouped GEMM (an MoE layer's experts, whose work is their routed tokens)."""
    low = kernel.lower()
    return any(m in low for m in GROUPED_GEMM_MARKERS)


def ep_group_ids(topology: JobTopology | None, ranks: Sequence[int] | I64) -> I64 | None:
    """Each rank's expert-parallel group (-1 for a rank outside ``topology``); None without a topology or
    expert parallelism (``ep_size`` < 2)."""
    if topology is None or topology.ep_size < 2:
        return None
    of = dict(zip(topology.rank, topology.ep_group, strict=True))
    return np.array([of.get(int(r), -1) for r in np.asarray(ranks).tolist()], dtype=np.int64)


def group_means(values: F64, group: I64) -> tuple[F64, npt.NDArray[np.bool_]]:
    """Per rank (rows of ``values``, ranks x columns), the mean of its group's rows, and whether there are at
    least two groups of two or more ranks to compare (else the means tell nothing). Ranks outside every
    group (-1) keep their own values."""
    out = values.copy()
    ids, counts = np.unique(group[group >= 0], return_counts=True)
    for g in ids.tolist():
        rows = group == g
        out[rows] = values[rows].mean(axis=0, keepdims=True)
    return out, np.asarray(int((counts >= 2).sum()) >= 2)


def per_token_scale(ranks: Sequence[int] | I64, tokens: Mapping[int, int] | None) -> F64 | None:
    """Per rank, the factor that turns its grouped-GEMM time into time per routed token (times the ranks'
    median tokens, so values stay on the scale of a call): ``median / tokens[rank]``. None unless every rank
    has a positive count (a comparison half per token and half per call would be no comparison)."""
    if not tokens:
        return None
    got = np.array([float(tokens.get(int(r), 0)) for r in np.asarray(ranks).tolist()])
    if got.size == 0 or not (got > 0).all():
        return None
    return np.asarray(np.median(got) / got, dtype=np.float64)


def repeated_expert(ranks: Iterable[int], topology: JobTopology | None) -> set[int]:
    """The ranks of ``ranks`` that hold one expert position in two expert-parallel groups or more, each the only
    one of ``ranks`` in its group, or in every group of the job: the signature of a popular expert, whose
    rank's compute phases run longer in each group that routes to it, not of faults (independent GPUs do not
    slow down at the same expert twice; a slow host slows every position of the groups it holds, so it names
    more than one member of a group). Empty without expert parallelism or with one group."""
    if topology is None or topology.ep_size < 2:
        return set()
    members: dict[int, list[int]] = {}
    for r, g in zip(topology.rank, topology.ep_group, strict=True):
        members.setdefault(g, []).append(r)
    if len(members) < 2:
        return set()
    where = {r: (g, i) for g, rs in members.items() for i, r in enumerate(sorted(rs))}
    named = {r for r in ranks if r in where}
    per_group = Counter(where[r][0] for r in named)
    out: set[int] = set()
    for pos in {where[r][1] for r in named}:
        at = {r for r in named if where[r][1] == pos}
        groups = {where[r][0] for r in at}
        if groups == set(members) or (len(groups) >= 2 and all(per_group[g] == 1 for g in groups)):
            out |= at
    return out


def hot_experts(ranks: Iterable[int], topology: JobTopology | None, tokens: Mapping[int, int] | None,
                ratio: float) -> set[int]:
    """The ranks of ``ranks`` whose routed tokens (``tokens``: per rank, counted over the same steps) are at
    least ``ratio`` times their expert-parallel group's median: a hot expert's rank, whose phases run longer
    by the work routed to it. Its own speed is judged per token on its grouped GEMMs
    (:func:`per_token_scale`), so its phase timings are not evidence of a fault. Empty without expert
    parallelism or token counts; ranks without a count are never hot."""
    if not tokens or topology is None or topology.ep_size < 2:
        return set()
    members: dict[int, list[int]] = {}
    for r, g in zip(topology.rank, topology.ep_group, strict=True):
        members.setdefault(g, []).append(r)
    group_of = {r: g for g, rs in members.items() for r in rs}
    out: set[int] = set()
    for r in ranks:
        group = group_of.get(r)
        if group is None or tokens.get(r, 0) <= 0:
            continue
        counts = [tokens[m] for m in members[group] if tokens.get(m, 0) > 0]
        if len(counts) >= 2 and tokens[r] >= ratio * float(np.median(counts)):
            out.add(r)
    return out
