"""Data-parallel collectives without code changes: DDP's gradient buckets and FSDP2's all-gathers and
reduce-scatters (a mixin of :class:`~argus.producers.tracer.Tracer`).

**DDP** (:meth:`DDPMixin.instrument_ddp`): a communication hook (``model.register_comm_hook``) times each
gradient bucket's all-reduce as an ALL_REDUCE phase ``dp-allreduce`` in the DP group, from the bucket's
launch until its future completes (CUDA: events on the tracer's communication stream, the end one recorded in
the future's callback, which runs on a stream synchronized with NCCL; gloo: the host clock until gloo
completes the future; see :mod:`argus.producers.tracer_patch`). The hook chains the hook that does the work:
see docs/internals/producers.md.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from argus.producers.cuda_timing import PhaseOpener
from argus.schemas.records import ParallelGroup, PhaseKind

__all__ = ["CommChain", "DDPMixin", "TimedComm"]

log = logging.getLogger(__name__)


class CommChain:
    """The state of the argus DDP communication hook: the tracer, the phase, and the hook it chains."""

    __slots__ = ("group", "hook", "name", "pgroup", "state", "tracer")

    def __init__(self, tracer: Any, name: str, pgroup: ParallelGroup, group: Any, hook: Callable[..., Any],
                 state: Any) -> None:
        self.tracer, self.name, self.pgroup, self.group = tracer, name, pgroup, group
        self.hook, self.state = hook, state

    def run(self, bucket: Any) -> Any:
        hook, state = self.hook, self.state
        tracer = self.tracer
        try:
            first = bucket.buffer()
        except Exception:
            first = None
        return tracer._timed_future(self.name, PhaseKind.ALL_REDUCE, self.pgroup, first, self.group,
                                    lambda: hook(state, bucket))


def _argus_comm_hook(state: CommChain, bucket: Any) -> Any:
    return state.run(bucket)


# DDP checks the hook's signature: a parameter named ``bucket`` without a string annotation.
_argus_comm_hook.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
    inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    inspect.Parameter("bucket", inspect.Parameter.POSITIONAL_OR_KEYWORD)])


class TimedComm:
    """Wraps one of FSDP2's comm objects (``AllGather`` / ``ReduceScatter``): times each call."""

    def __init__(self, tracer: Any, inner: Any, kind: PhaseKind) -> None:
        self.tracer, self.inner, self.kind = tracer, inner, kind

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
        tracer, inner = self.tracer, self.inner
        async_op = bool(kwargs.get("async_op", args[-1] if args and isinstance(args[-1], bool) else False))
        pgroup = tracer.group_kind(group)
        if pgroup is ParallelGroup.NONE:
            pgroup = ParallelGroup.DP
        suffix = "all-gather" if self.kind is PhaseKind.ALL_GATHER else "reduce-scatter"
        return tracer._timed_launch(f"{pgroup.value.lower()}-{suffix}", self.kind, pgroup, output_tensor, group,
                                    async_op, lambda: inner(output_tensor, input_tensor, group, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DDPMixin(PhaseOpener):
    """The DDP / FSDP2 instrumentation; mixed into :class:`~argus.producers.tracer.Tracer`."""

    def instrument_ddp(self, model: Any, *, name: str = "dp-allreduce",
                       parallel_group: ParallelGroup = ParallelGroup.DP) -> bool:
        """Time the gradient-bucket all-reduces of a ``DistributedDataParallel`` ``model`` (see the module
        docstring). Returns whether the buckets are timed; never raises. A second call for the same model
        re-targets its hook at this tracer (no second hook)."""
        try:
            chain = getattr(model, "_argus_chain", None)
            if isinstance(chain, CommChain):
                chain.tracer = self
                return True
            if not (hasattr(model, "register_comm_hook") and hasattr(model, "reducer")):
                return False
            if getattr(model, "_comm_hooks", None):
                log.warning("argus: this DDP model already has a communication hook (%s); its gradient buckets "
                            "are not timed (attach before register_comm_hook, or patch_collectives=True)",
                            model._comm_hooks[0][0])
                return False
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            group = getattr(model, "process_group", None)
            chain = CommChain(self, name, parallel_group, group, default_hooks.allreduce_hook, group)
            model.register_comm_hook(chain, _argus_comm_hook)
            model._argus_chain = chain
            _intercept_registration(model, chain, default_hooks)
            return True
        except Exception as exc:
            self._error("instrument_ddp", exc)
            return False

    def instrument_fsdp(self, model: Any) -> int:
        """Time the all-gathers and reduce-scatters of every FSDP2 (``fully_shard``) module in ``model``.
        Returns the number of parameter groups wrapped; never raises."""
        n = 0
        try:
            modules = list(model.modules()) if hasattr(model, "modules") else [model]
        except Exception as exc:
            self._error("instrument_fsdp", exc)
            return 0
        for mod in modules:
            get_state = getattr(mod, "_get_fsdp_state", None)
            if get_state is None:
                continue
            try:
                for pg in get_state()._fsdp_param_groups:
                    for attr, kind in (("_all_gather_comm", PhaseKind.ALL_GATHER),
                                       ("_reduce_scatter_comm", PhaseKind.REDUCE_SCATTER)):
                        comm = getattr(pg, attr)
                        if isinstance(comm, TimedComm):
                            comm.tracer = self
                        else:
                            setattr(pg, attr, TimedComm(self, comm, kind))
                    n += 1
            except Exception as exc:
                self._error("instrument_fsdp", exc)
        return n


def _intercept_registration(model: Any, chain: CommChain, default_hooks: Any) -> None:
    """Later ``register_comm_hook`` / ``_register_builtin_comm_hook`` calls on ``model`` replace the hook
    inside the chain (DDP itself accepts only one registration)."""

    def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
        model._check_comm_hook(hook)
        chain.hook, chain.state = hook, state

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        import torch.distributed as dist

        builtin = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        hook = builtin.get(comm_hook_type)
        if hook is None:
            raise ValueError(f"argus: built-in communication hook {comm_hook_type} is not supported")
        chain.hook, chain.state = hook, chain.group

    model.register_comm_hook = register_comm_hook
    model._register_builtin_comm_hook = register_builtin_comm_hook
