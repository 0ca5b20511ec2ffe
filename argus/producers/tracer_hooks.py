"""Module and optimizer hooks of the :class:`~argus.producers.tracer.Tracer` (a mixin): phases without editing the
model's code.

``instrument(model)`` times chosen submodules as phases named by their attribute name (every transformer
layer's ``self_attention`` and ``mlp``, as the L2 detector compares them across ranks), by wrapping their
``forward`` and optionally with full backward pre/post hooks; ``instrument_optimizer(opt)`` times ``optimizer.step()``
as an OPTIMIZER phase. A phase opened by a pre-hook is closed by the matching post-hook (a per-module stack;
posts that never come, after an exception inside the module, are forgotten). Activation checkpointing re-runs
forward hooks during backward: those recomputations appear as extra FORWARD phases.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from argus.producers.cuda_timing import PhaseOpener, PhaseRec
from argus.producers.heartbeat import MAX_DEPTH
from argus.schemas.records import ParallelGroup, PhaseKind

__all__ = ["HookMixin", "host_record"]


class HookMixin(PhaseOpener):
    """The hook methods; mixed into :class:`~argus.producers.tracer.Tracer`, which provides the state."""

    _handles: list[Any]
    _auto_begin: Callable[[], None]  # from argus.producers.tracer_auto.AutoMixin
    _auto_end: Callable[[], None]

    def instrument(self, model: Any, modules: Iterable[str] = ("self_attention", "mlp"), *, backward: bool = False,
                   match: Callable[[str, Any], bool] | None = None) -> list[Any]:
        """Time submodules as phases named by their attribute name (``layers.3.mlp`` -> ``mlp``).

        Submodules whose last name part is in ``modules`` (or for which ``match(qualified_name, module)``) get
        their ``forward`` wrapped (FORWARD phases: an instance attribute calling the module's own ``forward``,
        not forward hooks, because any hook sends every call of the module through torch's slow hook dispatch,
        about 1.5 µs; the phase also closes when ``forward`` raises) and, with ``backward``, full backward
        pre/post hooks (BACKWARD phases; these wrap the module's inputs/outputs in autograd functions, which
        in-place operations on them can conflict with). Returns the handles (``remove()``; removed by
        :meth:`close`).
        """
        wanted = set(modules)
        handles: list[Any] = []
        try:
            for qual, mod in model.named_modules():
                leaf = qual.rsplit(".", 1)[-1]
                if not qual or not (leaf in wanted or (match is not None and match(qual, mod))):
                    continue
                handles.append(self._wrap_forward(mod, leaf))
                if backward:
                    bpre, bpost = self._hook_pair(leaf, PhaseKind.BACKWARD)
                    handles += [mod.register_full_backward_pre_hook(bpre), mod.register_full_backward_hook(bpost)]
        except Exception as exc:
            self._error("instrument", exc)
        self._handles += handles
        return handles

    def count_expert_tokens(self, tokens: int) -> None:
        """Add ``tokens`` (an int >= 0: tokens routed to this rank's experts by one MoE layer, forward) to the
        current step's count. Outside a step it is ignored; anything but a non-negative int (a tensor would make
        the host wait for the GPU) is counted as an error and ignored: training never stops for it."""
        cur = getattr(self, "_cur", None)
        if cur is None:
            return
        if type(tokens) is not int or tokens < 0:
            self._error("count_expert_tokens", TypeError(f"tokens must be an int >= 0, got {type(tokens).__name__}"))
            return
        cur.expert_tokens = (cur.expert_tokens or 0) + tokens

    def instrument_optimizer(self, optimizer: Any, name: str = "optimizer", *, steps: bool = False,
                             phase: bool = True) -> list[Any]:
        """Time ``optimizer.step()`` as an OPTIMIZER phase (step pre/post hooks). Returns the handles.

        With ``steps`` (what ``argus.attach`` sets), ``optimizer.step()`` also marks iterations: it begins one
        when none is open and its end ends the iteration (``"auto"`` step mode, see
        :mod:`argus.producers.tracer_auto`). ``phase=False`` leaves the OPTIMIZER phase out (Lightning runs the
        forward and backward inside ``optimizer.step(closure)``). A wrapper without step hooks (accelerate's
        ``AcceleratedOptimizer``) is instrumented through its ``optimizer`` attribute.
        """
        target = optimizer
        inner = getattr(optimizer, "optimizer", None)  # accelerate / Lightning wrappers: hook the real one
        if inner is not None and hasattr(inner, "register_step_pre_hook"):
            target = inner
        if phase:
            open_pre, close_post = self._hook_pair(name, PhaseKind.OPTIMIZER)
        else:
            def open_pre(*_: Any) -> None:
                return None

            close_post = open_pre
        if steps:
            auto_begin, auto_end = self._auto_begin, self._auto_end

            def pre(*args: Any) -> None:
                auto_begin()
                open_pre(*args)

            def post(*args: Any) -> None:
                close_post(*args)
                auto_end()
        else:
            pre, post = open_pre, close_post
        try:
            handles = [target.register_step_pre_hook(pre), target.register_step_post_hook(post)]
        except Exception as exc:
            self._error("instrument_optimizer", exc)
            return []
        self._handles += handles
        return handles

    def _wrap_forward(self, mod: Any, name: str) -> _ForwardHandle:
        pre, post = self._hook_pair(name, PhaseKind.FORWARD)
        inner = mod.forward
        args0: tuple[Any, ...] = ()

        def forward(*args: Any, **kwargs: Any) -> Any:
            pre(mod, args0)
            try:
                return inner(*args, **kwargs)
            finally:
                post(mod, args0)

        mod.forward = forward
        return _ForwardHandle(mod, forward, inner)

    def _hook_pair(self, name: str, kind: PhaseKind) -> tuple[Callable[..., None], Callable[..., None]]:
        stack: list[PhaseRec | None] = []
        push, pop = stack.append, stack.pop
        none = ParallelGroup.NONE
        if getattr(self, "_pool", None) is None:  # host clock: the hot path of per-layer hooks, inlined
            return self._host_hook_pair(name, kind, stack)
        open_, close_ = self._open, self._close

        def pre(*_: Any) -> None:
            if len(stack) > 64:  # posts that never came (exceptions inside the module): forget them
                stack.clear()
            push(open_(name, kind, none, None))

        def post(*_: Any) -> None:
            rec = pop() if stack else None
            if rec is not None:
                close_(rec)

        return pre, post

    def _host_hook_pair(self, name: str, kind: PhaseKind, stack: list[PhaseRec | None]
                        ) -> tuple[Callable[..., None], Callable[..., None]]:
        """What ``_open`` / ``_close`` and ``LiveState.enter`` / ``exit`` do in host-clock mode, inlined: the
        per-layer hooks run on every module call (``load_tests/producer_overhead.py``: ``ns_per_module_call``).
        The records are the same (:func:`host_record` fills every slot of a PhaseRec)."""
        tracer: Any = self
        push, pop, perf, make = stack.append, stack.pop, time.perf_counter_ns, host_record
        live = tracer._live
        live_stack, leave = live.stack, live.exit
        cap = tracer._max_phases

        def pre(_module: Any, _args: Any, *_: Any) -> None:  # module forward/backward and optimizer step hooks
            cur = tracer._cur
            if cur is None:
                tracer._outside += 1
                push(None)
                return
            if len(stack) > 64:  # posts that never came (exceptions inside the module): forget them
                stack.clear()
            phases = cur.phases
            if len(phases) >= cap:
                cur.dropped_phases += 1
                push(None)
                return
            rec = make(name, kind, perf())
            phases.append(rec)
            d = live.depth  # LiveState.enter
            if d < MAX_DEPTH:
                live_stack[d] = rec
                live.depth = d + 1
                live.version += 1
            push(rec)

        def post(_module: Any, _args: Any, *_: Any) -> None:
            rec = pop() if stack else None
            if rec is None:
                return
            rec.t1 = perf()
            d = live.depth  # LiveState.exit, its usual case: the innermost phase ends
            if d and live_stack[d - 1] is rec:
                live_stack[d - 1] = None
                live.depth = d - 1
                live.version += 1
            else:
                leave(rec)

        return pre, post


class _ForwardHandle:
    """Undoes :meth:`HookMixin._wrap_forward` (as a hook's handle does), unless someone wrapped it again since."""

    def __init__(self, mod: Any, wrapper: Callable[..., Any], inner: Callable[..., Any]) -> None:
        self.mod, self.wrapper, self.inner = mod, wrapper, inner

    def remove(self) -> None:
        mod: Any = self.mod
        if vars(mod).get("forward") is not self.wrapper:
            return
        own_class = getattr(self.inner, "__func__", None) is getattr(type(mod), "forward", None)
        bound_here = getattr(self.inner, "__self__", None) is self.mod
        if bound_here and own_class:
            del mod.forward  # back to the class's forward
        else:
            mod.forward = self.inner


_new = object.__new__
_NONE = ParallelGroup.NONE


def host_record(name: str, kind: PhaseKind, t0: int) -> PhaseRec:
    """A host-clock :class:`PhaseRec` (stream -1, no events, group NONE) started at ``t0``: what
    ``PhaseRec(name, kind, ParallelGroup.NONE, -1, t0)`` makes, in about half its time."""
    rec: PhaseRec = _new(PhaseRec)
    rec.name = name
    rec.kind = kind
    rec.group = _NONE
    rec.stream = -1
    rec.t0 = t0
    rec.t1 = 0
    rec.ev0 = None
    rec.ev1 = None
    rec.on = None
    return rec


def _check_host_record() -> None:
    """host_record must set every slot PhaseRec has (a new slot would otherwise be unset in its records)."""
    rec = host_record("x", PhaseKind.OTHER, 1)
    ref = PhaseRec("x", PhaseKind.OTHER, ParallelGroup.NONE, -1, 1)
    if any(getattr(rec, s) != getattr(ref, s) for s in PhaseRec.__slots__):  # pragma: no cover
        raise AssertionError("argus.producers.tracer_hooks.host_record is out of date with PhaseRec")


_check_host_record()
