"""A minGPT-ddp-style trainer: a config dataclass, a ``Trainer`` with its own snapshot,
an epoch loop over a DataLoader with a ``DistributedSampler``, ported to stalwart.

Written in the style of minGPT's DDP example (none is copied): the model lives in the
script's own module (``_mingpt.py``, which the zygote preloads), a ``TrainerConfig``
(epochs, batch size, gradient clipping, snapshot path, ``save_every``), ``_run_batch`` /
``_run_epoch`` with ``sampler.set_epoch``, and ``_save_snapshot`` / ``_load_snapshot``
(model, optimizer, epochs run). With ``--plain`` it is the unported script. Ported
(docs/porting.md, "An epoch loop over your own DataLoader"): ``sess.steps()`` over the
same DataLoader wrapped by ``stalwart.data.epoch_batches``, the snapshot's load dropped,
its save kept inside ``sess.pause``. ``--steps`` ends the run after that many steps
(bench/recovery.py runs it longer than an epoch or two).

Additions for the corpus only: the dataset also returns the sample's index, and every
step's loss and indices go to ``--out`` (examples/corpus/_record.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
from _mingpt import GPT, GPTConfig, create_optimizer
from _record import Recorder
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import stalwart

Sample = tuple[torch.Tensor, torch.Tensor, int]


@dataclass
class TrainerConfig:
    max_epochs: int = 2
    batch_size: int = 4
    data_loader_workers: int = 0
    grad_norm_clip: float = 1.0
    snapshot_path: str = ""
    save_every: int = 1
    max_steps: int = 0  # 0: every epoch to the end


class CharDataset(Dataset[Sample]):
    """Chunks of a fixed text, encoded per character: (x, y = x shifted by one)."""

    def __init__(self, block_size: int, samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        text = torch.randint(0, 32, (samples + block_size + 1,), generator=g)
        self.data, self.block_size, self.samples = text, block_size, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, idx: int) -> Sample:
        chunk = self.data[idx : idx + self.block_size + 1]
        return chunk[:-1], chunk[1:], idx


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_dataset: Dataset[Sample],
        sess: stalwart.Session | None,
        rec: Recorder,
    ) -> None:
        self.config = config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.train_loader = self._prepare_dataloader(train_dataset)
        self.epochs_run = 0
        self.model = model
        self.optimizer = optimizer
        self.sess, self.rec = sess, rec
        if sess is None and os.path.exists(config.snapshot_path):  # stalwart restores instead
            self._load_snapshot()
        self.model = DDP(self.model)

    def _prepare_dataloader(self, dataset: Dataset[Sample]) -> DataLoader[Sample]:
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            pin_memory=False,
            shuffle=False,
            num_workers=self.config.data_loader_workers,
            sampler=DistributedSampler(dataset),
        )

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.config.snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["model_state"])
        self.optimizer.load_state_dict(snapshot["optimizer_state"])
        self.epochs_run = snapshot["finished_epoch"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = self.model(source, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
        self.optimizer.step()
        return loss

    def _log(self, step: int, loss: torch.Tensor, index: torch.Tensor) -> None:
        sess = self.sess
        if sess is not None:
            sess.log(loss=loss)  # stalwart
        if sess is None or sess.step_ok:
            world = sess.world_size if sess is not None else int(os.environ["WORLD_SIZE"])
            gen = sess.generation if sess is not None else 0
            self.rec.step(
                step,
                generation=gen,
                rank=self.global_rank,
                world=world,
                loss=loss.item(),
                samples=index.tolist(),
            )

    def _run_epoch(self, epoch: int, step: int) -> int:
        assert isinstance(self.train_loader.sampler, DistributedSampler)
        self.train_loader.sampler.set_epoch(epoch)
        for source, targets, index in self.train_loader:
            if self.config.max_steps and step >= self.config.max_steps:
                break
            step += 1
            self._log(step, self._run_batch(source, targets), index)
        return step

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "model_state": self.model.module.state_dict(),
            "optimizer_state": self.optimizer.state_dict(),
            "finished_epoch": epoch,
        }
        torch.save(snapshot, self.config.snapshot_path)
        print(f"Snapshot saved at epoch {epoch}")

    def total_steps(self) -> int:
        total = self.config.max_epochs * len(self.train_loader)
        return min(total, self.config.max_steps) if self.config.max_steps else total

    def train(self) -> None:
        if self.sess is None:
            step = self.epochs_run * len(self.train_loader)
            for epoch in range(self.epochs_run, self.config.max_epochs):
                step = self._run_epoch(epoch, step)
                if self.local_rank == 0 and epoch % self.config.save_every == 0:
                    self._save_snapshot(epoch)
            return
        sess = self.sess
        batches = stalwart.data.epoch_batches(self.train_loader)  # stalwart
        sess.track(model=self.model, optimizer=self.optimizer, data=batches)  # stalwart
        for step in sess.steps(total=self.total_steps()):  # stalwart
            source, targets, index = next(batches)
            self._log(step, self._run_batch(source, targets), index)
            epoch = batches.ended_epoch
            if epoch is not None and self.local_rank == 0 and epoch % self.config.save_every == 0:
                with sess.pause("save"):  # stalwart
                    self._save_snapshot(epoch)


def main() -> None:
    p = argparse.ArgumentParser(description="minGPT-style DDP training")
    p.add_argument("--out", required=True, help="folder for the trace and final digests")
    p.add_argument("--plain", action="store_true", help="the unported torchrun script")
    p.add_argument("--max_epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="end after this many steps (0: all)")
    p.add_argument("--samples", type=int, default=96)
    a = p.parse_args()
    sess = None
    if a.plain:
        init_process_group(backend="gloo")
    else:
        sess = stalwart.init()  # stalwart
    member = sess.env.rank if sess is not None else int(os.environ["RANK"])
    torch.manual_seed(3407)
    gpt_cfg = GPTConfig()
    model = GPT(gpt_cfg)
    optimizer = create_optimizer(model, learning_rate=3e-3, weight_decay=0.1)
    train_set = CharDataset(gpt_cfg.block_size, a.samples)
    max_epochs = a.max_epochs
    if a.steps:  # enough epochs for --steps
        per_epoch = -(-a.samples // (int(os.environ["WORLD_SIZE"]) * TrainerConfig.batch_size))
        max_epochs = max(max_epochs, -(-a.steps // per_epoch))
    config = TrainerConfig(
        max_epochs=max_epochs,
        snapshot_path=os.path.join(a.out, "snapshot.pt"),
        max_steps=a.steps,
    )
    rec = Recorder(a.out, member)
    trainer = Trainer(config, model, optimizer, train_set, sess, rec)
    trainer.train()
    rec.final(trainer.model.module.state_dict(), step=trainer.total_steps(), world=-1)
    if sess is not None:
        sess.close()  # stalwart
    else:
        destroy_process_group()


if __name__ == "__main__":
    main()
