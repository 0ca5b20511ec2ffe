"""What every rank tells the others at ``argus.attach``, through the job's c10d store, without a collective.

Each rank posts its host and the members of its process groups (:meth:`TopologyExchange.post`, one store
``set``, at once). The lifecycle rank, on a background thread, waits (bounded by ``timeout_s``) for every
rank's post, builds the job's topology from them and posts it; the other ranks' threads read that one key.
Nothing waits on the training thread, and a rank that never attaches costs the others only the timeout, after
which the lifecycle rank publishes the topology it could build alone.

Keys live under ``argus/<job_id>/`` in the default process group's store (the launcher's TCPStore under
torchrun). The job id itself can be agreed there too (:func:`agree`: the first rank's proposal wins).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Callable
from typing import Any

from argus.producers.topology import build_topology, topology_from_groups, with_hosts
from argus.schemas.records import JobTopology, ParallelGroup

__all__ = ["TopologyExchange", "agree", "default_store", "topology_from_posts"]

log = logging.getLogger(__name__)


def default_store() -> Any:
    """The default process group's store, or None (no process group, or torch without it)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def agree(store: Any, key: str, proposal: str) -> str:
    """The value every rank gets for ``key``: the first proposal stored (``compare_set``); ``proposal`` when the
    store fails."""
    try:
        got = store.compare_set(key, "", proposal)
        return got.decode() if isinstance(got, bytes) else str(got)
    except Exception as exc:
        log.warning("argus: could not agree on %s through the store: %s", key, exc)
        return proposal


def topology_from_posts(job_id: str, world_size: int, posts: list[dict[str, Any]],
                        degrees: dict[str, int] | None = None) -> JobTopology:
    """The topology from every rank's post (``{"host": ..., "gpu": ..., "groups": {"TP": [ranks], ...}}``, by
    rank; ``gpu`` may be missing).

    With ``degrees`` (explicit ``dp/tp/pp/ep``) the Megatron-order layout of those degrees; otherwise the
    groups the ranks reported (:func:`~argus.producers.topology.topology_from_groups`), else pure DP. The hosts
    are the posted ones, and so are the GPU ids. Raises ValueError when nothing consistent can be built.
    """
    topo = _from_posts(job_id, world_size, posts, degrees)
    gpus = tuple(str(p.get("gpu") or "") for p in posts)
    return dataclasses.replace(topo, gpu=gpus) if any(gpus) and len(gpus) == topo.world_size else topo


def _from_posts(job_id: str, world_size: int, posts: list[dict[str, Any]],
                degrees: dict[str, int] | None) -> JobTopology:
    hosts = [str(p.get("host", "")) or f"node{r:04d}" for r, p in enumerate(posts)]
    if degrees:
        tp, pp, ep = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("ep", 1)
        dp = degrees.get("dp", max(1, world_size // (tp * pp)))
        return with_hosts(build_topology(job_id, dp, tp, pp, ep, hosts_per_node=world_size), hosts)
    groups: dict[ParallelGroup, list[list[int]]] = {}
    for kind in (ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.EP):
        found = {tuple(sorted(p["groups"][kind.value])) for p in posts if kind.value in p.get("groups", {})}
        if not found:
            continue
        covered = {r for g in found for r in g}
        if covered != set(range(world_size)):  # some ranks did not report this kind: not usable
            log.warning("argus: the %s groups reported cover %d of %d ranks; not used", kind.value, len(covered),
                        world_size)
            continue
        groups[kind] = [list(g) for g in found]
    return topology_from_groups(job_id, world_size, groups, hosts)


class TopologyExchange:
    """One rank's side of the exchange (see the module docstring).

    Args:
        store: a c10d store shared by the job's ranks.
        job_id, rank, world_size: this rank.
        lifecycle: whether this rank builds and posts the topology.
        degrees: explicit degrees (``dp/tp/pp/ep``), passed to :func:`topology_from_posts`.
        timeout_s: how long the lifecycle rank waits for every post, and the others for the topology.
    """

    def __init__(self, store: Any, job_id: str, rank: int, world_size: int, *, lifecycle: bool,
                 degrees: dict[str, int] | None = None, timeout_s: float = 60.0) -> None:
        self.store, self.job_id, self.rank, self.world_size = store, job_id, rank, world_size
        self.lifecycle, self.degrees, self.timeout_s = lifecycle, degrees, timeout_s
        self._prefix = f"argus/{job_id}/"

    def _key(self, name: str) -> str:
        return self._prefix + name

    def post(self, host: str, groups: dict[ParallelGroup, list[int]], gpu: str = "") -> bool:
        """Post this rank's host, GPU id ('' unknown) and group members (one store ``set``). Returns whether it
        was stored."""
        try:
            body = {"host": host, "gpu": gpu, "groups": {k.value: list(v) for k, v in groups.items()}}
            self.store.set(self._key(f"rank/{self.rank}"), json.dumps(body))
            return True
        except Exception as exc:
            log.warning("argus rank %d: could not post its topology: %s", self.rank, exc)
            return False

    def _wait(self, keys: list[str]) -> bool:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
            return True
        except Exception as exc:
            log.warning("argus rank %d: topology exchange: %d keys not there after %.0f s (%s)", self.rank,
                        len(keys), self.timeout_s, type(exc).__name__)
            return False

    def resolve(self) -> JobTopology | None:
        """The job's topology (lifecycle rank: built from every post, then posted; other ranks: read), or None
        on timeout or failure (the caller keeps its local topology). Blocks up to ``timeout_s``: call it off
        the training thread."""
        if not self.lifecycle:
            if not self._wait([self._key("topology")]):
                return None
            return JobTopology.decode(bytes(self.store.get(self._key("topology"))))
        keys = [self._key(f"rank/{r}") for r in range(self.world_size)]
        if not self._wait(keys):
            return None
        posts = [json.loads(bytes(self.store.get(k)).decode()) for k in keys]
        try:
            topo = topology_from_posts(self.job_id, self.world_size, posts, self.degrees)
        except ValueError as exc:
            log.warning("argus: the reported process groups do not form a topology (%s); using degrees", exc)
            topo = topology_from_posts(self.job_id, self.world_size, posts, self._own_degrees(posts[0]))
        try:
            self.store.set(self._key("topology"), topo.encode())
        except Exception as exc:
            log.warning("argus: could not post the topology: %s", exc)
        return topo

    def _own_degrees(self, post: dict[str, Any]) -> dict[str, int]:
        sizes = {k.lower(): len(v) for k, v in post.get("groups", {}).items()}
        tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
        if self.world_size % (tp * pp):
            tp = pp = 1
        return {"tp": tp, "pp": pp, "dp": self.world_size // (tp * pp)}

    def resolver(self) -> Callable[[], JobTopology | None]:
        return self.resolve
