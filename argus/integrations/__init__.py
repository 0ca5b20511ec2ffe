"""Training-framework callbacks that trace a run with :func:`argus.attach`, no change to the training code.

* :class:`argus.integrations.lightning.ArgusCallback`: ``Trainer(callbacks=[ArgusCallback()])`` (Lightning 2,
  ``lightning`` or ``pytorch_lightning``).
* :class:`argus.integrations.hf.ArgusTrainerCallback`: ``Trainer(callbacks=[ArgusTrainerCallback()])``
  (Hugging Face ``transformers``).

Each module imports its framework only when imported itself; this package imports neither.
"""

__all__: list[str] = []
