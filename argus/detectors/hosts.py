"""Hosts whose GPUs run slow together: a joint test of one host's ranks against the other hosts' (pure).

A power cap or a thermal problem slows every GPU of a host a little: each rank alone may stay under the
per-rank gates of :func:`~argus.detectors.l3_ranks.detect_rank_excess` (a slowdown of 15 % that began half
way through the judged steps reads as 8 %), yet eight ranks slower together are plain. Each rank's speed is
its median log time per call over the kernels its comparison set (pipeline stage) runs alike; a host's ranks
are slow together when their mean speed stands ``min_z`` robust standard errors (and the Bonferroni bound of
``alpha`` over the hosts tested) and ``min_ratio`` above the other hosts' ranks, and ``min_share`` of them
are slower than those. Its slower ranks are named (``rank_degraded``), the host in their evidence; the
incident rules (:mod:`argus.detectors.incidents`) then make the host one ``node_degraded`` incident.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.special import ndtri

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.experts import is_grouped_gemm
from argus.detectors.l2_groups import MAD_SCALE
from argus.detectors.l3_kernels import L3Result, is_collective
from argus.detectors.l3_ranks import KernelTotals, set_speeds, totals_matrix
from argus.schemas.records import JobTopology

__all__ = ["HostParams", "detect_host_excess"]

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class HostParams:
    """Thresholds of :func:`detect_host_excess` (defaults in brackets). Raises :class:`DetectorError` for a
    value out of range."""

    #: Least ratio of a host's ranks' mean time per call over the other hosts' ranks' [1.05].
    min_ratio: float = 1.05
    #: Least z-score of that mean (robust standard errors of the other ranks' speeds) [5.0] ...
    min_z: float = 5.0
    #: ... and at least the Bonferroni bound of this family-wise rate over the hosts tested [0.001].
    alpha: float = 1e-3
    #: Least share of the host's ranks slower than the other hosts' median [0.75].
    min_share: float = 0.75
    #: Fewest ranks of a host in a comparison set, and of other hosts' ranks to compare with [2, 4].
    min_host_ranks: int = 2
    min_other_ranks: int = 4
    #: Fewest kernels every rank of the set runs with the same calls, each with this many calls [5, 8].
    min_kernels: int = 5
    min_calls: int = 8
    #: Least robust spread of the ranks' log speeds (0.5 %): identical ranks give no infinite z [0.005].
    spread_floor: float = 0.005
    collective_markers: tuple[str, ...] = ("nccl",)

    def __post_init__(self) -> None:
        if not (self.min_ratio > 1.0 and math.isfinite(self.min_ratio) and self.min_z >= 0.0
                and 0.0 < self.alpha < 1.0 and 0.0 < self.min_share <= 1.0 and self.spread_floor > 0.0):
            raise DetectorError("need min_ratio > 1, min_z >= 0, alpha and spread_floor in (0, 1), "
                                "min_share in (0, 1]")
        if self.min_host_ranks < 2 or self.min_other_ranks < 2 or self.min_kernels < 1 or self.min_calls < 1:
            raise DetectorError("need min_host_ranks, min_other_ranks >= 2 and min_kernels, min_calls >= 1")


def detect_host_excess(totals: Iterable[KernelTotals], topology: JobTopology | None,
                       params: HostParams | None = None, exclude: Iterable[int] = ()) -> list[L3Result]:
    """The slower ranks of hosts slow together (see the module docstring), one ``rank_degraded`` result per
    rank, ``excess_ns`` its time beyond the other hosts' speed. ``totals``: one per (kernel, stream) of the
    job; ``exclude``: ranks already named (left out of every test and never named here). Needs a topology with
    hosts; a host that is a whole comparison set is the stage's matter, never tested here."""
    p = params if params is not None else HostParams()
    if topology is None or len(set(topology.host)) < 2:
        return []
    routed = topology.ep_size >= 2
    usable = [t for t in totals if t.calls and not is_collective(t.kernel, p.collective_markers)
              and not (routed and is_grouped_gemm(t.kernel))]
    if not usable:
        return []
    ranks, total, calls, part, _ = totals_matrix(usable, topology)
    host_of = dict(zip(topology.rank, topology.host, strict=True))
    hosts = np.array([host_of.get(r, "") for r in ranks.tolist()])
    # Ranks already named are left out of every test: a straggler of its own would lift its host's mean.
    free = ~np.isin(ranks, np.fromiter(set(exclude), dtype=np.int64))
    out: list[L3Result] = []
    for g in np.unique(part[part >= 0]).tolist():
        rows = np.flatnonzero((part == g) & free)
        if rows.size < p.min_host_ranks + p.min_other_ranks:
            continue
        out += _judge_set(ranks[rows], hosts[rows], total[rows], calls[rows], usable, int(g), p)
    return out


def _judge_set(ranks: npt.NDArray[np.int64], hosts: npt.NDArray[np.str_], total: F64, calls: F64,
               usable: list[KernelTotals], part: int, p: HostParams) -> list[L3Result]:
    c = calls
    same = ((c >= p.min_calls).all(axis=0) & (c.max(axis=0) <= 1.02 * c.min(axis=0))
            & (np.nan_to_num(total) > 0).all(axis=0))
    cols = np.flatnonzero(same)
    names, counts = np.unique(hosts, return_counts=True)
    tested = [h for h, k in zip(names.tolist(), counts.tolist(), strict=True)
              if h and p.min_host_ranks <= k <= ranks.size - p.min_other_ranks]
    if cols.size < p.min_kernels or not tested:
        return []
    speed = set_speeds(np.log(total[:, cols] / c[:, cols]))  # each rank's log time per call against the set
    bound = max(p.min_z, float(ndtri(1.0 - p.alpha / len(tested))))
    out: list[L3Result] = []
    for h in tested:
        mine = hosts == h
        others = speed[~mine]
        ref = float(np.median(others))
        spread = max(MAD_SCALE * float(np.median(np.abs(others - ref))), p.spread_floor)
        shift = float(np.mean(speed[mine])) - ref
        z = shift / (spread / math.sqrt(int(mine.sum())))
        slower = mine & (speed > ref)
        if shift < math.log(p.min_ratio) or z < bound or slower.sum() < p.min_share * mine.sum():
            continue
        for i in np.flatnonzero(slower).tolist():
            # Its time beyond what the other hosts' speed gives for its calls, kernel by kernel.
            excess = total[i, cols] * (1.0 - math.exp(-(float(speed[i]) - ref)))
            top = int(cols[int(np.argmax(excess))])
            out.append(L3Result(FindingKind.RANK_DEGRADED, (int(ranks[i]),), usable[top].kernel, usable[top].stream,
                                float(math.exp(float(speed[i]) - ref)), evidence={
                                    "detector": "host_excess", "host": h, "host_ranks": int(mine.sum()),
                                    "host_speed_ratio": math.exp(shift), "host_z": z, "host_z_threshold": bound,
                                    "rank_speed_ratio": math.exp(float(speed[i]) - ref),
                                    "kernels_compared": int(cols.size), "n_ranks": int(ranks.size),
                                    "partition": part},
                                excess_ns=float(excess.sum())))
    return out
