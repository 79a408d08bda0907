"""integrations/lightning.py in one process: a real Lightning ``Trainer`` (a tiny MLP
with dropout, a shuffled DataLoader, a step LR schedule, a validation every 4 steps), a
stand-in session that rolls the tracked state back on demand
(tests/integrations/_fake.py), and the final parameters and every step's loss compared
with the same Trainer run without the callback.

The multi-process runs (a kill, a hang, a long validation under `stalwart run`) are cells
of tests/corpus/test_matrix.py (examples/corpus/lightning_trainer.py)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch", reason="the [lightning] extra is not installed")

import lightning.pytorch as L

from stalwart.errors import ConfigError
from stalwart.integrations._pl_loop import StepLoader
from stalwart.integrations.lightning import StalwartCallback, StalwartStrategy

from ._fake import FakeSession, same_params

pytestmark = pytest.mark.timeout(300)


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


def _fit(sess: FakeSession | None, max_steps: int = 14) -> tuple[list[torch.Tensor], Net]:
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


@pytest.fixture(scope="module")
def plain() -> tuple[list[torch.Tensor], Net]:
    return _fit(None)


def test_the_callback_changes_nothing_the_trainer_computes(plain: Any) -> None:
    sess = FakeSession()
    params, model = _fit(sess)
    assert same_params(params, plain[0])
    assert model.losses == plain[1].losses
    assert sess.yielded == list(range(1, 15))
    logged = [m for m in sess.logged if "loss" in m]
    assert len(logged) == 14, "self.log('loss') did not reach sess.log every step"
    assert any("val_loss" in m for m in sess.logged)
    assert "eval" in sess.pauses and sess.open_pauses == 0


@pytest.mark.parametrize(
    "fail_at",
    [
        {5: 3},  # inside an epoch
        {8: 5},  # back across the epoch boundary (6 steps an epoch)
        {2: 0},  # back to step 0
        {4: 3, 9: 8},  # the step of a validation (4, 8) and twice
        {14: 12},  # the last step
    ],
    ids=["mid-epoch", "across-epochs", "to-step-0", "val-steps-twice", "last-step"],
)
def test_a_rollback_finishes_bit_identical_to_the_plain_trainer(
    plain: Any, fail_at: dict[int, int]
) -> None:
    sess = FakeSession(fail_at=fail_at)
    params, model = _fit(sess)
    assert sess.generation == len(fail_at), "the rollbacks did not happen"
    assert same_params(params, plain[0]), "final parameters differ from the fault-free Trainer"
    assert model.losses == plain[1].losses, "a redone step's loss differs"
    assert model.vals == plain[1].vals


class _Resumed(FakeSession):
    """Starts from another run's step-5 snapshot, as a restored worker does."""

    def __init__(self, earlier: FakeSession, at: int) -> None:
        super().__init__(start_at=at)
        self.earlier = earlier

    def _snapshot(self, step: int) -> None:
        if step == self.start_at and step not in self.snapshots:
            self.snapshots[step] = self.earlier.snapshots[step]
        else:
            super()._snapshot(step)


@pytest.mark.parametrize("at", [5, 8])
def test_a_restored_worker_resumes_at_the_snapshot_without_ckpt_path(plain: Any, at: int) -> None:
    """A replacement process starts the script again: the session restores step ``at``
    at the first step, and the Trainer goes on from there, not from 0."""
    seen = FakeSession()
    _fit(seen)
    params, model = _fit(_Resumed(seen, at))
    assert min(model.losses) == at + 1, "the Trainer redid steps the job had done"
    assert same_params(params, plain[0])


def test_gradient_accumulation_is_refused_with_the_fix() -> None:
    cb = StalwartCallback(session=FakeSession())  # type: ignore[arg-type]
    trainer = L.Trainer(accumulate_grad_batches=2, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match="larger batch"):
        cb.setup(trainer, Net(), "fit")


def test_a_shuffling_random_sampler_is_refused_with_the_fix() -> None:
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 4))
    with pytest.raises(ConfigError, match="strategy='ddp'"):
        StepLoader(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))


def test_the_strategy_answers_set_up_collectives_locally_before_the_first_step() -> None:
    """Lightning's set-up barriers, broadcasts and reductions run before the job's group
    forms (at the first step): answered as if every rank held this one's value."""
    strategy = StalwartStrategy(session=FakeSession())  # type: ignore[arg-type]
    strategy.barrier("setup")  # no group: would raise if it reached torch.distributed
    assert strategy.broadcast({"log_dir": "x"}) == {"log_dir": "x"}
    t = torch.tensor([3])
    assert strategy.reduce(t) is t


# ------------------------------------------------------------ epoch-end saves
class _Saves(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []  # the global step of every checkpoint saved

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
        self.steps.append(trainer.global_step)


def _fit_saving(sess: FakeSession | None) -> tuple[list[torch.Tensor], _Saves, Any]:
    """6 steps an epoch, a validation at each epoch's end and the two best checkpoints
    by ``val_loss`` (ModelCheckpoint: its saves run collectives on every rank)."""
    L.seed_everything(0, verbose=False)
    model, saves = Net(), _Saves()
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


def test_a_rollback_across_an_epoch_end_redoes_its_checkpoint_save_as_a_replacement_does() -> None:
    """Step 7 fails just after the epoch-end validation and save of step 6; the rollback
    to 5 redoes step 6 and its save, on this survivor as on a replacement process (a
    fresh ModelCheckpoint): were the survivor to skip it (it saved step 6 already), its
    barriers and broadcasts would be missing on one rank, a collective that never ends."""
    plain_params, plain_saves, plain_scores = _fit_saving(None)
    assert plain_saves.steps == [6, 12, 14]
    sess = FakeSession(fail_at={7: 5})
    params, saves, scores = _fit_saving(sess)
    assert sess.generation == 1
    assert saves.steps == [6, 6, 12, 14], "the survivor skipped the redone save of step 6"
    assert same_params(params, plain_params) and scores == plain_scores
    # a replacement that resumes after the save holds the callback's state of that step
    seen = FakeSession()
    _fit_saving(seen)
    params, saves, scores = _fit_saving(_Resumed(seen, 7))
    assert saves.steps == [12, 14], "the replacement did not know step 6 was saved"
    assert same_params(params, plain_params) and scores == plain_scores
