"""Fail-slow detectors: per-window compression of kernel durations, distances between ranks, and diagnosis.

:mod:`argus.detectors.kde_clusters` turns a window's raw kernel durations into a few clusters per
(kernel, stream) group; :mod:`argus.detectors.mixture` rebuilds log-normal mixtures from those clusters and
measures how far ranks drift apart with the 1-Wasserstein distance (in ns). The progressive diagnosis
runs on top: :mod:`argus.detectors.l1_iteration` (iteration-time spikes and regressions),
:mod:`argus.detectors.l2_phases` (straggler rank and phase within parallel groups, slow pipeline stages),
:mod:`argus.detectors.l3_kernels` (degraded kernels, mode by mode with :mod:`argus.detectors.kernel_modes`, and links
from the compressed windows), :mod:`argus.detectors.l3_ranks` (ranks and pipeline stages slow across kernels),
:mod:`argus.detectors.kernel_excess` (a kernel slower on a rank than the rank's own speed predicts);
:mod:`argus.detectors.hangs` names stalled jobs, silent ranks and the ranks a hung collective waits for;
:mod:`argus.detectors.impact` gives each result the GPU time the job lost to it and :mod:`argus.detectors.findings`
turns results into Finding records.
"""

from argus.core.kinds import FindingKind
from argus.detectors.findings import DetectorResult, finding_id, to_finding, to_findings
from argus.detectors.hangs import HangParams, HangResult, RankLiveness, detect_hangs, job_resumed
from argus.detectors.impact import Impact, StepClock, impact_of, worth_raising
from argus.detectors.kde_clusters import (
    ClusterSet,
    ClusterSummary,
    KdeParams,
    binned_kde,
    cluster_by_group,
    cluster_durations,
)
from argus.detectors.kernel_excess import detect_kernel_excess
from argus.detectors.kernel_modes import ReferenceModes, mode_quantiles, reference_modes
from argus.detectors.l1_iteration import IterationSeries, L1Params, L1Result, detect_l1
from argus.detectors.l2_phases import L2Params, L2Result, PhaseTable, detect_l2, loo_median
from argus.detectors.l3_kernels import (
    L3Params,
    L3Result,
    RankScores,
    Scope,
    detect_l3,
    is_collective,
    primary_p50,
    score_ranks,
)
from argus.detectors.l3_ranks import (
    KernelTotals,
    RankExcessParams,
    detect_rank_excess,
    detect_stage_excess,
    kernel_family,
)
from argus.detectors.link_ledger import LinkLedger
from argus.detectors.links import LinkEvidence, LinkParams, PseudoGroup, detect_links
from argus.detectors.mixture import (
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
    "FindingKind",
    "HangParams",
    "HangResult",
    "Impact",
    "IterationSeries",
    "KdeParams",
    "KernelTotals",
    "L1Params",
    "L1Result",
    "L2Params",
    "L2Result",
    "L3Params",
    "L3Result",
    "LinkEvidence",
    "LinkLedger",
    "LinkParams",
    "Mixture",
    "MixtureBatch",
    "PhaseTable",
    "PseudoGroup",
    "RankExcessParams",
    "RankLiveness",
    "RankScores",
    "ReferenceModes",
    "Scope",
    "StepClock",
    "binned_kde",
    "cluster_by_group",
    "cluster_durations",
    "detect_hangs",
    "detect_kernel_excess",
    "detect_l1",
    "detect_l2",
    "detect_l3",
    "detect_links",
    "detect_rank_excess",
    "detect_stage_excess",
    "finding_id",
    "geometric_grid",
    "impact_of",
    "is_collective",
    "job_resumed",
    "kernel_family",
    "loo_median",
    "mixture_cdf",
    "mode_quantiles",
    "primary_p50",
    "reference_modes",
    "score_ranks",
    "to_finding",
    "to_findings",
    "w1_distance",
    "w1_matrix",
    "w1_to_reference",
    "worth_raising",
]
