"""A DDP tutorial-style script: a ``Trainer`` with its own snapshot save and resume.

Written in the style of the multi-GPU ``torchrun`` tutorial scripts people start from (none
is copied): ``init_process_group`` from torchrun's environment, a ``Trainer`` class that
loads ``snapshot.pt`` when it exists and saves one from local rank 0 every ``save_every``
epochs (its own resume: it restarts the epoch loop at the saved epoch, which it trains
again, as the tutorials do), a
``DistributedSampler`` with ``set_epoch``, and ``destroy_process_group()`` at the end.
It never imports stalwart. Its only addition is the final line rank 0 prints (and the
``final-m<RANK>.json`` under ``--out``, examples/corpus/_record.py): the sha256 of the
final parameters, so that two runs can be compared, and a run restarted after it finished
(which resumes from its snapshot and trains its last epochs again) shows a different one.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from _record import Recorder, digest
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size
        g = torch.Generator().manual_seed(0)  # the same data on every rank
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader[tuple[torch.Tensor, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(
            f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} "
            f"| Steps: {len(self.train_data)}"
        )
        assert isinstance(self.train_data.sampler, DistributedSampler)
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[MyTrainDataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(512)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(
    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]], batch_size: int
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, out: str) -> None:
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    state = trainer.model.module.state_dict()
    if out:
        Recorder(out, trainer.global_rank).final(state, step=total_epochs, world=-1)
    if trainer.global_rank == 0:
        print(f"final digest {digest(state)}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size per rank")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where the snapshot goes")
    parser.add_argument("--out", default="", help="folder for final-m<RANK>.json (corpus)")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.out)
