"""Fail-slow detectors: per-window compression of kernel durations and distances between ranks.

:mod:`detectors.kde_clusters` turns a window's raw kernel durations into a few clusters per
(kernel, stream) group; :mod:`detectors.mixture` rebuilds log-normal mixtures from those clusters and
measures how far ranks drift apart with the 1-Wasserstein distance (in ns).
"""

from detectors.kde_clusters import (
    ClusterSet,
    ClusterSummary,
    KdeParams,
    binned_kde,
    cluster_by_group,
    cluster_durations,
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
    "KdeParams",
    "Mixture",
    "MixtureBatch",
    "binned_kde",
    "cluster_by_group",
    "cluster_durations",
    "geometric_grid",
    "mixture_cdf",
    "w1_distance",
    "w1_matrix",
    "w1_to_reference",
]
