"""The DDP tutorial's epoch loop, ported to stalwart with ``stalwart.data.epoch_batches``.

Written in the style of the multi-GPU ``torchrun`` tutorial scripts (as
``ddp_tutorial.py``; none is copied): a ``Trainer`` over a ``DataLoader`` with a
``DistributedSampler`` (``set_epoch`` each epoch), SGD, a snapshot saved from local rank 0
every ``save_every`` epochs. With ``--plain`` it is the unported script (its epoch loop,
its own resume from the snapshot). Without, the port of docs/porting.md ("An epoch loop
over your own DataLoader"): the epoch loop becomes ``sess.steps()`` over the same
DataLoader wrapped by ``epoch_batches`` (same batches, same order, resumable mid-epoch),
the snapshot's load is dropped (stalwart restores the tracked state) and its save is kept
as the script's own artifact, inside ``sess.pause``. The model has dropout, so a draw
from the global RNG that the port added or lost would show in the loss.

Additions for the corpus only: the dataset also returns the sample's index, and every
step's loss and indices go to ``--out`` (examples/corpus/_record.py).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from _record import Recorder
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import stalwart

Sample = tuple[torch.Tensor, torch.Tensor, int]


class MyTrainDataset(Dataset[Sample]):
    def __init__(self, size: int) -> None:
        self.size = size
        g = torch.Generator().manual_seed(0)  # the same data on every rank
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Sample:
        return (*self.data[index], index)


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader[Sample],
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
        sess: stalwart.Session | None,
        out: str,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.sess = sess
        if sess is None and os.path.exists(snapshot_path):  # stalwart restores instead
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)
        member = sess.env.rank if sess is not None else self.global_rank
        self.rec = Recorder(out, member)
        self.step = 0

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _record(self, step: int, loss: torch.Tensor, index: torch.Tensor) -> None:
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

    def _run_epoch(self, epoch: int) -> None:
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)}")
        assert isinstance(self.train_data.sampler, DistributedSampler)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets, index in self.train_data:
            self.step += 1
            self._record(self.step, self._run_batch(source, targets), index)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        if self.sess is None:
            for epoch in range(self.epochs_run, max_epochs):
                self._run_epoch(epoch)
                if self.local_rank == 0 and epoch % self.save_every == 0:
                    self._save_snapshot(epoch)
            return
        sess = self.sess
        batches = stalwart.data.epoch_batches(self.train_data)  # stalwart
        sess.track(model=self.model, optimizer=self.optimizer, data=batches)  # stalwart
        for step in sess.steps(total=max_epochs * len(self.train_data)):  # stalwart
            source, targets, index = next(batches)
            self.step = step
            self._record(step, self._run_batch(source, targets), index)
            epoch = batches.ended_epoch
            if epoch is not None and self.local_rank == 0 and epoch % self.save_every == 0:
                with sess.pause("save"):  # stalwart
                    self._save_snapshot(epoch)


def load_train_objs() -> tuple[MyTrainDataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(256)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset[Sample], batch_size: int) -> DataLoader[Sample]:
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )


def main(a: argparse.Namespace) -> None:
    sess = None
    if a.plain:
        init_process_group(backend="gloo")
    else:
        sess = stalwart.init()  # stalwart
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, a.batch_size)
    snapshot_path = a.snapshot_path or os.path.join(a.out, "snapshot.pt")
    trainer = Trainer(model, train_data, optimizer, a.save_every, snapshot_path, sess, a.out)
    trainer.train(a.total_epochs)
    trainer.rec.final(trainer.model.module.state_dict(), step=trainer.step, world=-1)
    if sess is not None:
        sess.close()  # stalwart
    else:
        destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=16, type=int, help="Input batch size per rank")
    parser.add_argument("--snapshot_path", default="", help="default: snapshot.pt under --out")
    parser.add_argument("--out", required=True, help="folder for the trace and final digests")
    parser.add_argument("--plain", action="store_true", help="the unported torchrun script")
    main(parser.parse_args())
