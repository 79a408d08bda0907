"""A Lightning script: a tiny MLP regressor trained by ``lightning.pytorch.Trainer`` with
stalwart's callback.

Written the way Lightning scripts are: ``seed_everything``, a ``LightningModule`` with
``training_step``/``validation_step``/``configure_optimizers`` (AdamW, a per-step cosine
schedule), ``self.log``, a ``LightningDataModule`` with shuffled training data,
``Trainer(strategy="ddp", max_steps=..., val_check_interval=...)`` and ``trainer.fit``.
Lightning builds the DistributedSampler, the DDP model, the optimizer and the scheduler.

The two stalwart lines are marked ``# stalwart``; ``--plain`` runs the same script without
them (under torchrun). ``Record`` only writes what tests/corpus/test_matrix.py judges a
run by (examples/corpus/_record.py): it is not part of the style. ``--eval_pause S`` makes
every validation batch at least S seconds longer (CPU-busy); ``--bug_step N`` makes the
rank launched as ``--bug_rank`` raise at step N. ``--epoch_end`` validates at every
epoch's end (not every ``--val_every`` steps) and keeps the two best checkpoints by
``val_loss`` (a ``ModelCheckpoint``: its save runs collectives on every rank) in the
logger's ``lightning_logs/version_N/checkpoints``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning.pytorch as L
import torch
from _record import Recorder
from torch.utils.data import DataLoader, Dataset


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """y = a fixed random projection of x, plus noise: sample i is a function of i."""

    def __init__(self, n: int, salt: int) -> None:
        self.n, self.salt = n, salt
        self.w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.salt * 100_003 + i)
        x = torch.randn(8, generator=g)
        return x, x @ self.w + 0.1 * torch.randn(1, generator=g), torch.tensor(i)


class Data(L.LightningDataModule):
    def __init__(self, train: int, val: int, batch: int) -> None:
        super().__init__()
        self.train, self.val, self.batch = train, val, batch

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(self.train, 1), batch_size=self.batch, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(self.val, 2), batch_size=self.batch)


class Net(L.LightningModule):
    def __init__(self, lr: float, max_steps: int, eval_pause: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.bug = 0  # the step at which this rank raises (--bug_step on --bug_rank)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.bug == self.global_step + 1:  # a deterministic bug, inside the step
            raise ValueError("corpus-bug: label 7 out of range in shard file 3")
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        t_end = time.monotonic() + self.hparams["eval_pause"]
        z = torch.ones(64, 64)
        while time.monotonic() < t_end:  # CPU-busy, as a long validation is
            z = torch.tanh(z @ z)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams["max_steps"])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cos, "interval": "step"}}


class Record(L.Callback):
    """The trace of examples/corpus/_record.py: one line per attempt of a step."""

    def __init__(self, rec: Recorder, stalwart: Any) -> None:
        self.rec, self.stalwart = rec, stalwart

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        gen, rank, world = 0, trainer.global_rank, trainer.world_size
        if self.stalwart is not None:
            sess = self.stalwart.session
            gen, rank, world = sess.generation, sess.rank, sess.world_size
        self.rec.step(
            trainer.global_step,
            generation=gen,
            rank=rank,
            world=world,
            loss=float(out["loss"]),
            lr=trainer.optimizers[0].param_groups[0]["lr"],
            samples=batch[2].tolist(),
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="a plain torchrun script: no stalwart")
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--max_steps", type=int, default=16)
    p.add_argument("--train_samples", type=int, default=64)
    p.add_argument("--val_samples", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--val_every", type=int, default=6)
    p.add_argument("--eval_pause", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bug_step", type=int, default=0, help="raise at this step (0: never)")
    p.add_argument("--bug_rank", type=int, default=1)
    p.add_argument("--epoch_end", action="store_true", help="validate+checkpoint per epoch")
    a = p.parse_args()

    strategy: Any = "ddp"
    if not a.plain:
        from stalwart.integrations.lightning import StalwartStrategy  # stalwart

        strategy = StalwartStrategy()  # stalwart: joins the job, DDP over its group
    member = int(os.environ.get("RANK", "0"))
    if not a.plain:
        member = strategy.session.env.rank
    rec = Recorder(a.out, member)
    callbacks: list[L.Callback] = [Record(rec, strategy if not a.plain else None)]
    if a.epoch_end:  # into the logger's version folder, as Lightning's examples do
        callbacks.append(L.callbacks.ModelCheckpoint(monitor="val_loss", save_top_k=2))

    L.seed_everything(42, verbose=False)
    model = Net(a.lr, a.max_steps, a.eval_pause)
    if member == a.bug_rank:
        model.bug = a.bug_step
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1"))
        // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=a.max_steps,
        val_check_interval=None if a.epoch_end else a.val_every,
        check_val_every_n_epoch=1 if a.epoch_end else None,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=a.epoch_end,
        default_root_dir=os.path.join(a.out, "pl"),
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=Data(a.train_samples, a.val_samples, a.batch_size))
    rec.final(model.state_dict(), step=a.max_steps, world=trainer.world_size)


if __name__ == "__main__":
    main()
