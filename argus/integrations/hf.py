"""Hugging Face ``transformers``: ``Trainer(..., callbacks=[ArgusTrainerCallback()])`` traces every rank.

What it does, on every rank (never raising into training; failures are warnings, counted by the tracer):

* ``on_train_begin``: :func:`argus.attach` with the Trainer's model and optimizer: the whole model's FORWARD
  ``forward`` and BACKWARD ``backward`` phases (module hooks; the backward ends before DDP's final bucket
  wait), the optimizer's OPTIMIZER phase (accelerate's wrapper is seen through), and DDP's gradient buckets:
  the DDP wrapper is ``trainer.model_wrapped`` when the callback was given the ``trainer``
  (``trainer.add_callback(ArgusTrainerCallback(trainer))``), else it is looked up once among the objects
  that refer to the model (``gc.get_referrers``, two levels);
* ``on_step_begin`` / ``on_step_end``: the iteration boundaries (``"external"`` mode: one iteration per
  optimizer step, gradient-accumulation micro-batches included);
* ``on_train_end``: closes the tracer (on every rank: the job's record counts are summed for END).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from transformers import TrainerCallback

__all__ = ["ArgusTrainerCallback", "find_ddp"]

log = logging.getLogger(__name__)


def find_ddp(model: Any) -> Any:
    """The ``DistributedDataParallel`` that wraps ``model``, found among its referrers (None if none)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return None
    if isinstance(model, DistributedDataParallel):
        return model
    try:
        for ref in gc.get_referrers(model):
            if isinstance(ref, DistributedDataParallel) and ref.module is model:
                return ref
            if isinstance(ref, dict):
                for owner in gc.get_referrers(ref):
                    if isinstance(owner, DistributedDataParallel) and owner.module is model:
                        return owner
                    if isinstance(owner, dict):
                        for inst in gc.get_referrers(owner):
                            if isinstance(inst, DistributedDataParallel) and inst.module is model:
                                return inst
    except Exception as exc:
        log.debug("argus: DDP lookup failed: %s", exc)
    return None


class ArgusTrainerCallback(TrainerCallback):
    """Trace a ``transformers.Trainer`` run with argus (see the module docstring).

    Args:
        trainer: the Trainer, when known (its ``model_wrapped`` is the DDP to time); optional.
        attach_kwargs: passed to :func:`argus.attach` (``job_id``, ``settings``, ``publisher``, ``modules``,
            ``patch_collectives``, ...).
    """

    def __init__(self, trainer: Any = None, **attach_kwargs: Any) -> None:
        self.trainer = trainer
        self.attach_kwargs = attach_kwargs
        self.tracer: Any = None

    def _safe(self, where: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            if self.tracer is not None:
                self.tracer._error(f"transformers {where}", exc)
            else:
                log.warning("argus transformers %s failed: %s: %s", where, type(exc).__name__, exc)
            return None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        from argus.producers.attach import attach

        self.tracer = attach(model, optimizer, **self.attach_kwargs)
        if model is None:
            return
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
        try:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        except Exception:
            distributed = False
        if wrapped is None and distributed:
            wrapped = self._safe("DDP lookup", find_ddp, model)
        if wrapped is not None and wrapped is not model:
            self._safe("DDP", self.tracer.instrument_ddp, wrapped)
            self._safe("FSDP", self.tracer.instrument_fsdp, wrapped)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracer is not None:
            self._safe("step begin", self.tracer.begin_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracer is not None:
            self._safe("step end", self.tracer.end_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            tracer.close()
