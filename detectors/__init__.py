"""Fail-slow detectors: per-window compression of kernel durations, distances between ranks, and diagnosis.

:mod:`detectors.kde_clusters` turns a window's raw kernel durations into a few clusters per
(kernel, stream) group; :mod:`detectors.mixture` rebuilds log-normal mixtures from those clusters and
measures how far ranks drift apart with the 1-Wasserstein distance (in ns). The progressive diagnosis
runs on top: :mod:`detectors.l1_iteration` (iteration-time spikes and regressions),
:mod:`detectors.l2_phases` (straggler rank and phase within parallel groups, slow pipeline stages),
:mod:`detectors.l3_kernels` (degraded kernels and links from the compressed windows), and
:mod:`detectors.findings` turns their results into Finding records.
"""

from detectors.findings import DetectorResult, finding_id, to_finding, to_findings
from detectors.kde_clusters import (
    ClusterSet,
    ClusterSummary,
    KdeParams,
    binned_kde,
    cluster_by_group,
    cluster_durations,
)
from detectors.l1_iteration import IterationSeries, L1Kind, L1Params, L1Result, detect_l1
from detectors.l2_phases import L2Kind, L2Params, L2Result, PhaseTable, detect_l2, loo_median
from detectors.l3_kernels import (
    L3Kind,
    L3Params,
    L3Result,
    RankScores,
    Scope,
    detect_l3,
    is_collective,
    primary_p50,
    score_ranks,
)
from detectors.mixture import (
    Mixture,
    MixtureBatch,
    geometric_grid,
    mixture_cdf,
    w1_distance,
    w1_matrix,
    w1_to_reference,
)

__all__ = [
    "ClusterSet",
    "ClusterSummary",
    "DetectorResult",
    "IterationSeries",
    "KdeParams",
    "L1Kind",
    "L1Params",
    "L1Result",
    "L2Kind",
    "L2Params",
    "L2Result",
    "L3Kind",
    "L3Params",
    "L3Result",
    "Mixture",
    "MixtureBatch",
    "PhaseTable",
    "RankScores",
    "Scope",
    "binned_kde",
    "cluster_by_group",
    "cluster_durations",
    "detect_l1",
    "detect_l2",
    "detect_l3",
    "finding_id",
    "geometric_grid",
    "is_collective",
    "loo_median",
    "mixture_cdf",
    "primary_p50",
    "score_ranks",
    "to_finding",
    "to_findings",
    "w1_distance",
    "w1_matrix",
    "w1_to_reference",
]
