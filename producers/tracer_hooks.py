"""Module and optimizer hooks of the :class:`~producers.tracer.Tracer` (a mixin): phases without editing the
model's code.

``instrument(model)`` times chosen submodules as phases named by their attribute name (every transformer
layer's ``self_attention`` and ``mlp``, as the L2 detector compares them across ranks), with forward pre/post
hooks and optionally full backward pre/post hooks; ``instrument_optimizer(opt)`` times ``optimizer.step()``
as an OPTIMIZER phase. A phase opened by a pre-hook is closed by the matching post-hook (a per-module stack;
posts that never come, after an exception inside the module, are forgotten). Activation checkpointing re-runs
forward hooks during backward: those recomputations appear as extra FORWARD phases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from producers.cuda_timing import PhaseOpener, PhaseRec
from schemas.records import ParallelGroup, PhaseKind

__all__ = ["HookMixin"]


class HookMixin(PhaseOpener):
    """The hook methods; mixed into :class:`~producers.tracer.Tracer`, which provides the state."""

    _handles: list[Any]

    def instrument(self, model: Any, modules: Iterable[str] = ("self_attention", "mlp"), *, backward: bool = False,
                   match: Callable[[str, Any], bool] | None = None) -> list[Any]:
        """Time submodules as phases named by their attribute name (``layers.3.mlp`` -> ``mlp``).

        Submodules whose last name part is in ``modules`` (or for which ``match(qualified_name, module)``) get
        forward pre/post hooks (FORWARD phases) and, with ``backward``, full backward pre/post hooks
        (BACKWARD phases; these wrap the module's inputs/outputs in autograd functions, which in-place
        operations on them can conflict with). Returns the hook handles (removed by :meth:`close`).
        """
        wanted = set(modules)
        handles: list[Any] = []
        try:
            for qual, mod in model.named_modules():
                leaf = qual.rsplit(".", 1)[-1]
                if not qual or not (leaf in wanted or (match is not None and match(qual, mod))):
                    continue
                pre, post = self._hook_pair(leaf, PhaseKind.FORWARD)
                handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
                if backward:
                    bpre, bpost = self._hook_pair(leaf, PhaseKind.BACKWARD)
                    handles += [mod.register_full_backward_pre_hook(bpre), mod.register_full_backward_hook(bpost)]
        except Exception as exc:
            self._error("instrument", exc)
        self._handles += handles
        return handles

    def instrument_optimizer(self, optimizer: Any, name: str = "optimizer") -> list[Any]:
        """Time ``optimizer.step()`` as an OPTIMIZER phase (step pre/post hooks). Returns the handles."""
        pre, post = self._hook_pair(name, PhaseKind.OPTIMIZER)
        try:
            handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        except Exception as exc:
            self._error("instrument_optimizer", exc)
            return []
        self._handles += handles
        return handles

    def _hook_pair(self, name: str, kind: PhaseKind) -> tuple[Callable[..., None], Callable[..., None]]:
        stack: list[PhaseRec | None] = []

        def pre(*_: Any) -> None:
            if len(stack) > 64:  # posts that never came (exceptions inside the module): forget them
                stack.clear()
            stack.append(self._open(name, kind, ParallelGroup.NONE, None))

        def post(*_: Any) -> None:
            rec = stack.pop() if stack else None
            if rec is not None:
                self._close(rec)

        return pre, post
