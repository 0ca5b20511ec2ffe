"""Which parallel group (DP, TP, PP, EP) each ``torch.distributed`` process group of this rank is.

Sources, first match per kind wins: see docs/internals/producers.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from argus.schemas.records import ParallelGroup

__all__ = ["GroupMap", "classify_name", "discover_groups", "kind_of_name", "members"]

log = logging.getLogger(__name__)

_WORDS: dict[ParallelGroup, frozenset[str]] = {
    ParallelGroup.TP: frozenset({"tp", "tensor"}),
    ParallelGroup.PP: frozenset({"pp", "pipe", "pipeline"}),
    ParallelGroup.EP: frozenset({"ep", "expert", "experts", "moe"}),
    ParallelGroup.DP: frozenset({"dp", "data", "ddp", "fsdp", "hsdp", "replicate", "shard"}),
}
_ALIASES = {"dp": ParallelGroup.DP, "tp": ParallelGroup.TP, "pp": ParallelGroup.PP, "ep": ParallelGroup.EP,
            "data": ParallelGroup.DP, "tensor": ParallelGroup.TP, "pipeline": ParallelGroup.PP,
            "expert": ParallelGroup.EP}

#: kind -> this rank's process group of that kind.
GroupMap = dict[ParallelGroup, Any]


def classify_name(name: str) -> ParallelGroup | None:
    """The kind a process group's description or name says it is (None: no kind or more than one)."""
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    kinds = [k for k, w in _WORDS.items() if words & w]
    return kinds[0] if len(kinds) == 1 else None


def kind_of_name(key: ParallelGroup | str) -> ParallelGroup:
    """``"dp"``/``"tensor"``/``ParallelGroup.TP`` ... as a :class:`ParallelGroup`. Raises ValueError."""
    if isinstance(key, ParallelGroup):
        return key
    try:
        return _ALIASES[str(key).lower()]
    except KeyError:
        raise ValueError(f"unknown parallel group kind {key!r} (dp, tp, pp or ep)") from None


def members(group: Any) -> list[int] | None:
    """The global ranks of ``group`` (ascending), None when they cannot be told."""
    try:
        import torch.distributed as dist

        return sorted(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:
        return None


def _megatron() -> GroupMap:
    try:
        from megatron.core import parallel_state as ps
    except Exception:
        return {}
    out: GroupMap = {}
    try:
        if not ps.model_parallel_is_initialized():
            return {}
    except Exception:
        return {}
    getters: tuple[tuple[ParallelGroup, str, dict[str, Any]], ...] = (
        (ParallelGroup.TP, "get_tensor_model_parallel_group", {}),
        (ParallelGroup.PP, "get_pipeline_model_parallel_group", {}),
        (ParallelGroup.DP, "get_data_parallel_group", {"with_context_parallel": False}),
        (ParallelGroup.EP, "get_expert_model_parallel_group", {}))
    for kind, name, kwargs in getters:
        fn = getattr(ps, name, None)
        if fn is None:
            continue
        try:
            try:
                g = fn(**kwargs)
            except TypeError:
                g = fn()
        except Exception as exc:  # not initialized for this kind
            log.debug("megatron %s: %s", name, exc)
            continue
        if g is not None:
            out[kind] = g
    return out


def _named() -> GroupMap:
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return {}
        world = dist.distributed_c10d._world
        pgs = list(world.pg_map)
        names = dict(world.pg_names)
    except Exception as exc:
        log.debug("process groups not readable: %s", exc)
        return {}
    best: dict[ParallelGroup, tuple[int, Any]] = {}
    default = dist.group.WORLD
    for pg in pgs:
        if pg is default:
            continue
        kind = None
        for text in (getattr(pg, "group_desc", None), names.get(pg)):
            if isinstance(text, str) and text:
                kind = classify_name(text)
                if kind is not None:
                    break
        if kind is None:
            continue
        ranks = members(pg)
        size = len(ranks) if ranks else 0
        if kind not in best or size > best[kind][0]:
            best[kind] = (size, pg)
    return {k: pg for k, (_, pg) in best.items()}


def discover_groups(explicit: Mapping[ParallelGroup | str, Any] | None = None) -> GroupMap:
    """This rank's process group of each parallel kind that can be told (see the module docstring)."""
    out: GroupMap = {}
    for key, group in (explicit or {}).items():
        try:
            out[kind_of_name(key)] = group
        except ValueError as exc:
            log.warning("argus: %s", exc)
    for source in (_megatron, _named):
        try:
            found = source()
        except Exception as exc:  # pragma: no cover - the sources catch their own errors
            log.warning("argus: process group discovery (%s) failed: %s", source.__name__, exc)
            continue
        for kind, group in found.items():
            out.setdefault(kind, group)
    return out
