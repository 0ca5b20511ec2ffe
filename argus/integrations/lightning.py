"""Lightning: ``Trainer(callbacks=[ArgusCallback()])`` traces every rank of a ``fit`` run.

The callback subclasses the ``Callback`` of ``lightning.pytorch`` when that imports, else of
``pytorch_lightning`` (a Trainer accepts only its own package's callbacks).

What it does, on every rank (nothing here raises into training; failures are warnings, counted by the tracer):
see docs/internals/application.md.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from argus.schemas.records import PhaseKind

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

__all__ = ["ArgusCallback", "pl"]

log = logging.getLogger(__name__)


class ArgusCallback(pl.Callback):
    """Trace a Lightning ``fit`` with argus (see the module docstring).

    Args:
        attach_kwargs: passed to :func:`argus.attach` (``job_id``, ``settings``, ``publisher``,
            ``patch_collectives``, ...).
    """

    def __init__(self, **attach_kwargs: Any) -> None:
        super().__init__()
        self.attach_kwargs = attach_kwargs
        self.tracer: Any = None
        self._opt_phase: Any = None
        self._wrapped: Any = None
        self._hooked: list[Any] = []

    def _safe(self, where: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            if self.tracer is not None:
                self.tracer._error(f"lightning {where}", exc)
            else:
                log.warning("argus lightning %s failed: %s: %s", where, type(exc).__name__, exc)
            return None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.tracer is None:
            from argus.producers.attach import attach

            self.tracer = attach(**self.attach_kwargs)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.tracer is None:
            return
        self._safe("model", self._instrument, trainer, pl_module)

    def _instrument(self, trainer: Any, pl_module: Any) -> None:
        tracer = self.tracer
        wrapped = getattr(trainer.strategy, "model", None)
        if wrapped is not None:
            tracer.instrument_ddp(wrapped)
            tracer.instrument_fsdp(wrapped)
        original = pl_module.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            with tracer.phase("forward", PhaseKind.FORWARD):
                return original(*args, **kwargs)

        pl_module.training_step = training_step
        self._wrapped = pl_module
        for opt in trainer.optimizers:
            target = getattr(opt, "optimizer", opt)  # a LightningOptimizer wraps the real one
            if not hasattr(target, "register_step_post_hook"):
                target = opt
            handle = target.register_step_post_hook(self._optimizer_done)
            tracer._handles.append(handle)
            self._hooked.append(handle)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.tracer is not None:
            self._safe("batch start", self.tracer.begin_step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.tracer is not None:
            self._safe("backward", self.tracer.time_backward, loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.tracer is None:
            return
        self._optimizer_done()
        phase = self.tracer.phase("optimizer", PhaseKind.OPTIMIZER)
        self._safe("optimizer start", phase.__enter__)
        self._opt_phase = phase

    def _optimizer_done(self, *_: Any) -> None:
        phase, self._opt_phase = self._opt_phase, None
        if phase is not None:
            self._safe("optimizer end", phase.__exit__, None, None, None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.tracer is not None:
            self._optimizer_done()
            self._safe("batch end", self.tracer.end_step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.tracer is None:
            return
        self._optimizer_done()
        if self._wrapped is not None and "training_step" in vars(self._wrapped):
            self._safe("unwrap", delattr, self._wrapped, "training_step")
        self._wrapped = None
        for handle in self._hooked:
            self._safe("unhook", handle.remove)
        self._hooked.clear()
        tracer, self.tracer = self.tracer, None
        tracer.close()
