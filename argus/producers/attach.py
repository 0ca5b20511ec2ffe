"""``argus.attach(model, optimizer)``: the one line that traces a training script.

On each rank (any launcher: ``torchrun``, Slurm, ``torch.multiprocessing``)::

    model = DDP(model)                      # or an FSDP2 / plain model
    optimizer = torch.optim.AdamW(model.parameters())
    argus.attach(model, optimizer)          # after init_process_group, on every rank

What it does, never raising into training (a failure is logged as a warning, counted in the tracer's
``stats().errors``, and the rest goes on; in the worst case a disabled tracer comes back):
see docs/internals/producers.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from argus.producers.exchange import TopologyExchange, agree, default_store
from argus.producers.gpu_ids import gpu_id
from argus.producers.groups import discover_groups, members
from argus.producers.topology import build_topology, parse_topology_spec, with_hosts
from argus.producers.tracer import Tracer, _NullPublisher
from argus.schemas.records import ParallelGroup

__all__ = ["RankEnv", "attach", "current_tracer", "detach", "read_env", "tracer_from_env"]

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
#: attach() arguments that choose what to instrument (the rest go to the Tracer).
_INSTRUMENT_ARGS = ("modules", "backward", "ddp", "fsdp", "steps", "patch_collectives", "close_timeout_s")


@dataclass(frozen=True)
class RankEnv:
    """What the environment says about this rank (None: not set, or not readable; see ``problems``)."""

    rank: int | None
    world_size: int | None
    local_rank: int | None
    job_id: str | None
    topology: dict[str, int]
    patch_collectives: bool
    disabled: bool
    problems: tuple[str, ...] = ()


def read_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the job id (``ARGUS_JOB_ID``, ``TORCHELASTIC_RUN_ID``
    unless empty or ``none``, ``SLURM_JOB_ID``), ``ARGUS_TOPOLOGY``, ``ARGUS_PATCH_COLLECTIVES`` and
    ``ARGUS_DISABLE`` from ``env`` (default ``os.environ``). Never raises: unreadable values are None and
    listed in ``problems``."""
    env = os.environ if env is None else env
    problems: list[str] = []

    def integer(name: str) -> int | None:
        text = env.get(name, "").strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            problems.append(f"{name}={text!r} is not an integer")
            return None
        if value < 0:
            problems.append(f"{name}={value} is negative")
            return None
        return value

    job = env.get("ARGUS_JOB_ID", "").strip() or None
    if job is None:
        run = env.get("TORCHELASTIC_RUN_ID", "").strip()
        job = run if run and run.lower() != "none" else None
    if job is None:
        slurm = env.get("SLURM_JOB_ID", "").strip()
        job = f"slurm-{slurm}" if slurm else None
    topology: dict[str, int] = {}
    spec = env.get("ARGUS_TOPOLOGY", "").strip()
    if spec:
        try:
            topology = parse_topology_spec(spec)
        except ValueError as exc:
            problems.append(f"ARGUS_TOPOLOGY: {exc}")
    return RankEnv(rank=integer("RANK"), world_size=integer("WORLD_SIZE"), local_rank=integer("LOCAL_RANK"),
                   job_id=job, topology=topology,
                   patch_collectives=env.get("ARGUS_PATCH_COLLECTIVES", "").strip().lower() in _TRUE,
                   disabled=env.get("ARGUS_DISABLE", "").strip().lower() in _TRUE, problems=tuple(problems))


def _dist() -> Any:
    try:
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def _proposal() -> str:
    stem = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python"))[0] or "job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _degrees(world: int, explicit: dict[str, int], own: dict[ParallelGroup, list[int]]) -> dict[str, int]:
    """dp/tp/pp/ep for the local topology: explicit ones first, else the sizes of this rank's groups."""
    sizes = {k.value.lower(): len(v) for k, v in own.items()}
    tp = explicit.get("tp", sizes.get("tp", 1))
    pp = explicit.get("pp", sizes.get("pp", 1))
    ep = explicit.get("ep", sizes.get("ep", 1))
    dp = explicit.get("dp", world // (tp * pp) if world % (tp * pp) == 0 else 0)
    if dp < 1 or dp * tp * pp != world or dp % ep:
        log.warning("argus: degrees dp=%s tp=%s pp=%s ep=%s do not fit %d ranks; using dp=%d", dp, tp, pp, ep,
                    world, world)
        return {"dp": world, "tp": 1, "pp": 1, "ep": 1}
    return {"dp": dp, "tp": tp, "pp": pp, "ep": ep}


def tracer_from_env(settings: Any = None, *, env: Mapping[str, str] | None = None, publisher: Any = None,
                    cls: type[Tracer] = Tracer, groups: Mapping[ParallelGroup | str, Any] | None = None,
                    exchange: bool = True, exchange_timeout_s: float = 60.0, **overrides: Any) -> Tracer:
    """A tracer (not started) for this rank from the environment (see :func:`read_env` and the module
    docstring). ``overrides`` are Tracer arguments (``job_id``, ``rank``, ``world_size``, ``dp``/``tp``/``pp``/
    ``ep``, ``topology``, ``cuda``, ``kernels``, ...) that win over the environment; ``groups`` names process
    groups explicitly (``{"tp": tp_group}``). With ``exchange`` and a c10d store, the ranks exchange hosts and
    group members at start (no collective). Raises ValueError for an inconsistent rank / world size."""
    renv = read_env(env)
    for problem in renv.problems:
        log.warning("argus: %s (ignored)", problem)
    dist = _dist()
    rank = overrides.pop("rank", None)
    world = overrides.pop("world_size", None)
    if dist is not None:
        d_rank, d_world = dist.get_rank(), dist.get_world_size()
        if (renv.rank, renv.world_size) not in ((None, None), (d_rank, d_world)):
            log.warning("argus: RANK/WORLD_SIZE say %s/%s, the process group %d/%d: using the process group",
                        renv.rank, renv.world_size, d_rank, d_world)
        rank = d_rank if rank is None else rank
        world = d_world if world is None else world
    rank = (renv.rank or 0) if rank is None else int(rank)
    world = (renv.world_size or 1) if world is None else int(world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not within world size {world}")
    store = default_store() if dist is not None else None
    job_id = overrides.pop("job_id", None) or renv.job_id
    if not job_id:
        if store is not None:
            job_id = agree(store, "argus/job_id", _proposal())
        else:
            job_id = _proposal()
            if world > 1:
                log.warning("argus: no ARGUS_JOB_ID / TORCHELASTIC_RUN_ID and no process group: rank %d calls "
                            "its job %r, the other ranks will not agree; set ARGUS_JOB_ID", rank, job_id)
    found = discover_groups(groups) if dist is not None else {}
    own: dict[ParallelGroup, list[int]] = {}
    for kind, pg in found.items():
        ranks = members(pg)
        if ranks and rank in ranks:
            own[kind] = ranks
    explicit = {k: int(overrides[k]) for k in ("dp", "tp", "pp", "ep") if overrides.get(k) is not None}
    explicit = explicit or dict(renv.topology)
    deg = _degrees(world, explicit, own)
    for k in ("dp", "tp", "pp", "ep"):
        overrides.pop(k, None)
    topology = overrides.pop("topology", None)
    host = overrides.get("host")
    tracer = cls(settings, str(job_id), rank, world, publisher, dp=deg["dp"], tp=deg["tp"], pp=deg["pp"],
                 ep=deg["ep"], topology=topology, **overrides)
    tracer.local_rank = renv.local_rank if renv.local_rank is not None else rank
    if topology is None:
        local = build_topology(tracer.job_id, deg["dp"], deg["tp"], deg["pp"], deg["ep"],
                               hosts_per_node=max(1, world))
        if world == 1:
            local = with_hosts(local, [host or tracer.host])
            gpu = gpu_id()
            local = dataclasses.replace(local, gpu=(gpu,)) if gpu else local
        tracer._topology = local
        if exchange and store is not None and world > 1:
            ex = TopologyExchange(store, tracer.job_id, rank, world, lifecycle=tracer._lifecycle,
                                  degrees=explicit or None, timeout_s=exchange_timeout_s)
            ex.post(tracer.host, own, gpu_id())
            tracer._topology_fn = ex.resolve
    for kind, pg in found.items():
        tracer.set_group_kind(pg, kind)
    return tracer


# -- the process's tracer ------------------------------------------------------------------------------------

_lock = threading.RLock()
_state: dict[str, Any] = {"tracer": None, "hooks_installed": False, "next_step": 0, "timeout_s": 30.0}
_models: weakref.WeakKeyDictionary[Any, Tracer] = weakref.WeakKeyDictionary()
_optimizers: weakref.WeakKeyDictionary[Any, Tracer] = weakref.WeakKeyDictionary()
_by_id: dict[int, Tracer] = {}


def current_tracer() -> Tracer | None:
    """The tracer :func:`attach` made for this process (None before, or after it was closed)."""
    t = _state["tracer"]
    return t if t is not None and not t._closed else None


def detach(timeout_s: float = 30.0) -> None:
    """Close the tracer :func:`attach` made (if any) and forget every model and optimizer it instrumented, so
    the next :func:`attach` starts afresh (a new job in the same process, or a test)."""
    t = current_tracer()
    if t is not None:
        t.close(timeout_s=timeout_s)
    _state.update(tracer=None, next_step=0)
    _models.clear()
    _optimizers.clear()
    _by_id.clear()


def _disabled() -> Tracer:
    t = Tracer(None, "argus-disabled", 0, 1, _NullPublisher(), kernels=False, lifecycle=False, registry=False,
               heartbeat=False, reduce_counts=False, cuda=False)
    t._closed = True  # hooks and wrappers pass through; close() is a no-op
    return t


def _close_current(reason: str, timeout_s: float | None = None) -> None:
    tracer = current_tracer()
    if tracer is None:
        return
    timeout = float(_state["timeout_s"] if timeout_s is None else timeout_s)
    log.info("argus: closing the tracer (%s)", reason)
    _state["next_step"] = tracer._next_step
    if reason == "atexit":  # bounded: a peer that died must not hold the interpreter's exit
        worker = threading.Thread(target=tracer.close, kwargs={"timeout_s": timeout}, daemon=True,
                                  name="argus-close")
        worker.start()
        worker.join(timeout + 5.0)
        if worker.is_alive():
            log.warning("argus: tracer close still running after %.0f s at exit; abandoned", timeout + 5.0)
        return
    tracer.close(timeout_s=timeout)


def _install_process_hooks() -> None:
    if _state["hooks_installed"]:
        return
    _state["hooks_installed"] = True
    atexit.register(_close_current, "atexit")
    try:
        import torch.distributed as dist

        orig = dist.destroy_process_group
        if getattr(orig, "_argus_wrapped", False):
            return

        @functools.wraps(orig)
        def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
            if group is None or group is dist.group.WORLD:
                try:
                    _close_current("destroy_process_group")
                except Exception as exc:  # pragma: no cover - close() catches its own errors
                    log.warning("argus: close at destroy_process_group failed: %s", exc)
            return orig(group, *args, **kwargs)

        destroy_process_group._argus_wrapped = True  # type: ignore[attr-defined]
        dist.destroy_process_group = destroy_process_group
    except Exception as exc:
        log.debug("argus: destroy_process_group not wrapped: %s", exc)


def _is_ddp(model: Any) -> bool:
    return hasattr(model, "reducer") and hasattr(model, "register_comm_hook")


def _instrument(tracer: Tracer, model: Any, optimizer: Any, opts: dict[str, Any]) -> None:
    if model is not None:
        known = _get(_models, model)
        if known is not tracer:
            _put(_models, model, tracer)
            if opts.get("ddp", True) and _is_ddp(model):
                tracer.instrument_ddp(model)
            if opts.get("fsdp", True):
                tracer.instrument_fsdp(model)
            tracer.instrument_model(model, backward="backward" if opts.get("backward", True) else None,
                                    steps=bool(opts.get("steps", True)))
            modules: Iterable[str] = opts.get("modules") or ()
            if modules:
                tracer.instrument(model, modules=modules)
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if opt is None or _get(_optimizers, opt) is tracer:
            continue
        first = not any(t is tracer for t in _optimizers.values())  # the first optimizer marks iterations
        _put(_optimizers, opt, tracer)
        tracer.instrument_optimizer(opt, steps=first and bool(opts.get("steps", True)))


def _get(table: weakref.WeakKeyDictionary[Any, Tracer], key: Any) -> Tracer | None:
    try:
        return table.get(key)
    except TypeError:  # not weak-referenceable: by id (kept for the process's life)
        return _by_id.get(id(key))


def _put(table: weakref.WeakKeyDictionary[Any, Tracer], key: Any, tracer: Tracer) -> None:
    try:
        table[key] = tracer
    except TypeError:
        _by_id[id(key)] = tracer


def attach(model: Any = None, optimizer: Any = None, **overrides: Any) -> Tracer:
    """Trace this rank of a training job: start the process's tracer and instrument ``model`` and
    ``optimizer`` (one, or a list: the first marks iterations). Never raises; see the module docstring.

    Args:
        model: a ``torch.nn.Module``: DDP-wrapped, FSDP2 (``fully_shard``) or plain.
        optimizer: a ``torch.optim.Optimizer`` (or accelerate's wrapper), or a list of them.
        overrides: Tracer arguments (``settings``, ``publisher``, ``job_id``, ``rank``, ``world_size``,
            ``dp``/``tp``/``pp``/``ep``, ``topology``, ``groups``, ``cuda``, ``kernels``, ``heartbeat``, ...;
            see :func:`tracer_from_env`) and what to instrument: ``modules`` (names of submodules to time as
            their own FORWARD phases, e.g. ``("self_attention", "mlp")``; default none), ``backward`` (the
            BACKWARD phase, default True), ``ddp`` / ``fsdp`` (default True), ``steps`` (iteration boundaries
            from the hooks, default True), ``patch_collectives`` (default ``ARGUS_PATCH_COLLECTIVES``) and
            ``close_timeout_s`` (seconds ``close`` may take at exit, default 30).

    Returns:
        the process's :class:`~argus.producers.tracer.Tracer` (started); ``with tracer.step():`` and
        ``tracer.phase(...)`` still work on it.
    """
    opts = {k: overrides.pop(k) for k in _INSTRUMENT_ARGS if k in overrides}
    try:
        with _lock:
            tracer = current_tracer()
            if tracer is None:
                renv = read_env(overrides.get("env"))
                if renv.disabled:
                    return _disabled()
                tracer = tracer_from_env(**overrides)
                tracer._next_step = _state["next_step"]  # a second tracer of the process continues the count
                _state["tracer"] = tracer
                _state["timeout_s"] = float(opts.get("close_timeout_s", 30.0))
                _install_process_hooks()
                tracer.start()
                patch = opts.get("patch_collectives")
                if patch if patch is not None else renv.patch_collectives:
                    tracer.patch_collectives()
            elif overrides:
                log.warning("argus: attach() already made this process's tracer; ignoring %s", sorted(overrides))
            _instrument(tracer, model, optimizer, opts)
            return tracer
    except Exception as exc:
        log.warning("argus: attach failed, training goes on untraced: %s: %s", type(exc).__name__, exc)
        t = current_tracer()
        if t is not None:
            t._errors += 1
            return t
        return _disabled()
