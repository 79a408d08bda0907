"""The Lightning half of tests/integrations/test_lightning.py: a tiny MLP and a Trainer
over it. Imported by that module's ``pl`` fixture when a test runs, so that collecting
the suite does not import Lightning (seconds on a loaded machine)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import lightning.pytorch as L
import torch

from stalwart.integrations.lightning import StalwartCallback, StalwartStrategy

from ._fake import FakeSession

__all__ = ["L", "Net", "Saves", "StalwartCallback", "StalwartStrategy", "fit", "fit_saving"]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.losses: dict[int, float] = {}  # per global step: a redone step overwrites
        self.vals: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = loss.item()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.vals[self.global_step] = loss.item()
        self.log("val_loss", loss)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data(n: int, salt: int, shuffle: bool) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(salt)
    x = torch.randn(n, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    if not shuffle:
        return torch.utils.data.DataLoader(ds, batch_size=4)
    # what Lightning's DDP strategy puts in (a single-device Trainer keeps a RandomSampler)
    sampler: torch.utils.data.Sampler[int] = torch.utils.data.DistributedSampler(
        ds, num_replicas=1, rank=0, seed=salt
    )
    return torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler)


def fit(sess: FakeSession | None, max_steps: int = 14) -> tuple[list[torch.Tensor], Net]:
    """6 steps an epoch (24 samples, batch 4), a validation every 4 steps."""
    L.seed_everything(0, verbose=False)
    model = Net()
    callbacks: list[L.Callback] = [StalwartCallback(session=sess)] if sess is not None else []  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            default_root_dir=out, max_steps=max_steps, accelerator="cpu", devices=1,
            val_check_interval=4, check_val_every_n_epoch=None, log_every_n_steps=1,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            logger=False, callbacks=callbacks, num_sanity_val_steps=1,
        )  # fmt: skip
        trainer.fit(model, _data(24, 1, shuffle=True), _data(8, 2, shuffle=False))
    return [p.detach().clone() for p in model.parameters()], model


class Saves(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []  # the global step of every checkpoint saved

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
        self.steps.append(trainer.global_step)


def fit_saving(sess: FakeSession | None) -> tuple[list[torch.Tensor], Saves, Any]:
    """6 steps an epoch, a validation at each epoch's end and the two best checkpoints
    by ``val_loss`` (ModelCheckpoint: its saves run collectives on every rank)."""
    L.seed_everything(0, verbose=False)
    model, saves = Net(), Saves()
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = L.callbacks.ModelCheckpoint(out, monitor="val_loss", save_top_k=2)
        callbacks: list[L.Callback] = [ckpt, saves]
        if sess is not None:
            callbacks.append(StalwartCallback(session=sess))  # type: ignore[arg-type]
        trainer = L.Trainer(
            default_root_dir=out, max_steps=14, accelerator="cpu", devices=1,
            log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
            logger=False, callbacks=callbacks, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(model, _data(24, 1, shuffle=True), _data(8, 2, shuffle=False))
    scores = sorted(float(v) for v in ckpt.best_k_models.values())
    return [p.detach().clone() for p in model.parameters()], saves, scores
