"""Steps and phases without code changes (a mixin of :class:`~argus.producers.tracer.Tracer`).

:meth:`AutoMixin.instrument_model` times the whole model: its forward as one FORWARD phase (``forward``,
forward pre/post hooks on the module given) and its backward as one BACKWARD phase (``backward``): when the
forward's output has a tensor that requires grad, a hook on that tensor opens the phase when the gradient
reaches the model's output, and an autograd-engine callback (``queue_callback``, as DDP and FSDP use) closes
it when the backward pass has computed every gradient -- before DDP's final wait for its gradient buckets, so
waiting for a slow peer shows in the DP all-reduce phases, not in BACKWARD. Nothing wraps the model's inputs or
outputs (no full backward hooks): in-place operations on the output stay legal.

Iteration boundaries, three modes (:attr:`Tracer.step_mode`): see docs/internals/producers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from argus.producers.cuda_timing import PhaseOpener, PhaseRec, StepRec
from argus.schemas.records import ParallelGroup, PhaseKind

try:
    import torch as _torch
except ImportError:  # pragma: no cover
    _torch = None  # type: ignore[assignment]
torch: Any = _torch

__all__ = ["STEP_MODES", "AutoMixin", "first_grad_tensor"]

#: The iteration-boundary modes (see the module docstring).
STEP_MODES = ("auto", "external", "manual")


def first_grad_tensor(value: Any, depth: int = 0) -> Any:
    """The first tensor in ``value`` (a tensor, mapping, sequence or dataclass-like model output, searched
    3 levels deep) that requires grad and has a ``grad_fn``; None if there is none."""
    if torch is not None and isinstance(value, torch.Tensor):
        return value if value.requires_grad and value.grad_fn is not None else None
    if depth >= 3 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return None
    if isinstance(value, dict) or (hasattr(value, "values") and callable(value.values)):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return None
    for v in items:
        t = first_grad_tensor(v, depth + 1)
        if t is not None:
            return t
    return None


class AutoMixin(PhaseOpener):
    """Whole-model phases and automatic iteration boundaries; the state lives in the Tracer."""

    _cur: StepRec | None
    _closed: bool
    _handles: list[Any]
    _step_mode: str
    _begin_step: Callable[[int | None], int]  # the Tracer's
    _end_step: Callable[[], None]

    @property
    def step_mode(self) -> str:
        """``"auto"``, ``"external"`` or ``"manual"`` (see the module docstring)."""
        return self._step_mode

    def begin_step(self, step: int | None = None) -> int:
        """Begin an iteration now (ending the open one); switches to ``"external"`` boundaries. Returns its
        number. For callbacks that see batch boundaries; scripts use ``with tracer.step():``."""
        if self._step_mode != "manual":
            self._step_mode = "external"
        return self._begin_step(step)

    def end_step(self) -> None:
        """End the open iteration (if any); switches to ``"external"`` boundaries."""
        if self._step_mode != "manual":
            self._step_mode = "external"
        self._end_step()

    def instrument_model(self, model: Any, *, name: str = "forward", backward: str | None = "backward",
                         steps: bool = True) -> list[Any]:
        """Time ``model``'s whole forward as a FORWARD phase ``name`` and its backward as a BACKWARD phase
        ``backward`` (None: no backward phase); with ``steps``, a training forward begins an iteration when
        none is open (modes ``auto``/``external``). Returns the hook handles (removed by :meth:`close`);
        never raises (a model without hook support yields no handles and one counted error)."""
        stack: list[PhaseRec | None] = []
        open_, close_, fwd = self._open, self._close, PhaseKind.FORWARD
        none = ParallelGroup.NONE

        def pre(module: Any, _args: Any) -> None:
            if self._cur is None:
                if (not steps or self._closed or self._step_mode == "manual" or not module.training
                        or not torch.is_grad_enabled()):
                    stack.append(None)
                    return
                self._begin_step(None)
            if len(stack) > 64:
                stack.clear()
            stack.append(open_(name, fwd, none, None))

        def post(_module: Any, _args: Any, output: Any) -> None:
            rec = stack.pop() if stack else None
            if rec is None:
                return
            close_(rec)
            if backward is not None and torch.is_grad_enabled():
                t = first_grad_tensor(output)
                if t is not None:
                    t.register_hook(self._backward_hook(backward))

        try:
            handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
        except Exception as exc:
            self._error("instrument_model", exc)
            return []
        self._handles += handles
        return handles

    def time_backward(self, tensor: Any, name: str = "backward") -> bool:
        """Time the backward pass that starts at ``tensor`` (e.g. the loss) as a BACKWARD phase ``name``.
        Returns whether a hook was placed (False for a tensor that does not require grad)."""
        try:
            t = first_grad_tensor(tensor)
            if t is None:
                return False
            t.register_hook(self._backward_hook(name))
            return True
        except Exception as exc:
            self._error("time_backward", exc)
            return False

    def _backward_hook(self, name: str) -> Callable[[Any], None]:
        def on_grad(_grad: Any) -> None:  # once per backward pass through this tensor (retain_graph: again)
            rec = self._open(name, PhaseKind.BACKWARD, ParallelGroup.NONE, None)
            if rec is None:
                return
            try:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._close(rec))
            except Exception as exc:
                self._close(rec)
                self._error("backward end callback", exc)

        return on_grad

    def _auto_begin(self) -> None:
        if self._cur is None and not self._closed and self._step_mode != "manual":
            self._begin_step(None)

    def _auto_end(self) -> None:
        if self._step_mode == "auto" and self._cur is not None:
            self._end_step()
