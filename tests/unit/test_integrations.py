"""The Lightning and Hugging Face callbacks on CPU: a tiny model, a few steps, a recording publisher.

Each test is skipped when its framework is not installed (``pip install pytorch-lightning transformers
accelerate``; see the dev extras)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from argus.producers import attach as attach_mod  # noqa: E402
from argus.producers.rank_registry import RankRegistry  # noqa: E402
from argus.schemas.records import JobLifecycle, LifecycleEvent, PhaseBatch, PhaseKind, Step  # noqa: E402
from tests.samples import RecordingPublisher  # noqa: E402

STEPS = 4


@pytest.fixture(autouse=True)
def fresh_process_state() -> Iterator[None]:
    yield
    attach_mod.detach(timeout_s=2)


def attach_kwargs(tmp_path: Path, pub: RecordingPublisher, job: str) -> dict[str, Any]:
    return {"publisher": pub, "kernels": False, "registry": RankRegistry(tmp_path / "reg"), "heartbeat": False,
            "env": {"ARGUS_JOB_ID": job}, "cuda": False}


def phase_kinds(batch: PhaseBatch) -> dict[str, PhaseKind]:
    return dict(zip(batch.names, batch.kinds, strict=True))


@pytest.mark.slow
def test_lightning_callback(tmp_path: Path) -> None:
    integration = pytest.importorskip("argus.integrations.lightning")  # lightning.pytorch or pytorch_lightning
    pl, ArgusCallback = integration.pl, integration.ArgusCallback  # noqa: N806

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return (self.net(x) - y).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    pub = RecordingPublisher(check=True)
    module = Tiny()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=[ArgusCallback(**attach_kwargs(tmp_path, pub, "pl"))])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    assert "training_step" not in vars(module)  # the wrapper is gone after teardown
    assert [s.step for s in pub.of(Step)] == list(range(STEPS))
    for b in pub.of(PhaseBatch):
        assert phase_kinds(b) == {"forward": PhaseKind.FORWARD, "backward": PhaseKind.BACKWARD,
                                  "optimizer": PhaseKind.OPTIMIZER}, b.names
        fwd, bwd, opt = (b.names.index(n) for n in ("forward", "backward", "optimizer"))
        assert b.start_ns[fwd] <= b.start_ns[bwd] <= b.start_ns[opt]
    end = pub.of(JobLifecycle)[-1]
    assert end.event is LifecycleEvent.END and end.steps == STEPS
    assert attach_mod.current_tracer() is None  # closed at teardown


@pytest.mark.slow
def test_hf_trainer_callback(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from argus.integrations.hf import ArgusTrainerCallback, find_ddp

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def forward(self, x: Any, labels: Any = None) -> Any:
            out = self.net(x)
            return {"loss": (out - labels).square().mean(), "logits": out}

    rows = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(32)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS,
                                          per_device_train_batch_size=8, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                          dataloader_num_workers=0)
    pub = RecordingPublisher(check=True)
    model = Tiny()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[ArgusTrainerCallback(**attach_kwargs(tmp_path, pub, "hf"))])
    trainer.train()
    assert [s.step for s in pub.of(Step)] == list(range(STEPS))
    for b in pub.of(PhaseBatch):
        assert phase_kinds(b) == {"forward": PhaseKind.FORWARD, "backward": PhaseKind.BACKWARD,
                                  "optimizer": PhaseKind.OPTIMIZER}, b.names
    assert pub.of(JobLifecycle)[-1].steps == STEPS
    assert find_ddp(model) is None


def test_hf_finds_the_ddp_wrapper(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from argus.integrations.hf import find_ddp

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        inner = torch.nn.Linear(2, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
        assert find_ddp(inner) is ddp and find_ddp(ddp) is ddp
    finally:
        dist.destroy_process_group()
