"""integrations/lightning.py in one process: a real Lightning ``Trainer`` (a tiny MLP
with dropout, a shuffled DataLoader, a step LR schedule, a validation every 4 steps), a
stand-in session that rolls the tracked state back on demand
(tests/integrations/_fake.py), and the final parameters and every step's loss compared
with the same Trainer run without the callback.

The multi-process runs (a kill, a hang, a long validation under `stalwart run`) are cells
of tests/corpus/test_matrix.py (examples/corpus/lightning_trainer.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stalwart.errors import ConfigError
from stalwart.integrations._pl_loop import StepLoader

from ._fake import FakeSession, same_params

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pl() -> Any:
    """tests/integrations/_lightning_fit.py, imported when a test needs it: collecting the
    suite does not import Lightning."""
    pytest.importorskip("lightning.pytorch", reason="the [lightning] extra is not installed")
    from . import _lightning_fit

    return _lightning_fit


@pytest.fixture(scope="module")
def plain(pl: Any) -> Any:
    return pl.fit(None)


def test_the_callback_changes_nothing_the_trainer_computes(plain: Any, pl: Any) -> None:
    sess = FakeSession()
    params, model = pl.fit(sess)
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
    plain: Any, pl: Any, fail_at: dict[int, int]
) -> None:
    sess = FakeSession(fail_at=fail_at)
    params, model = pl.fit(sess)
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
def test_a_restored_worker_resumes_at_the_snapshot_without_ckpt_path(
    plain: Any, pl: Any, at: int
) -> None:
    """A replacement process starts the script again: the session restores step ``at``
    at the first step, and the Trainer goes on from there, not from 0."""
    seen = FakeSession()
    pl.fit(seen)
    params, model = pl.fit(_Resumed(seen, at))
    assert min(model.losses) == at + 1, "the Trainer redid steps the job had done"
    assert same_params(params, plain[0])


def test_gradient_accumulation_is_refused_with_the_fix(pl: Any) -> None:
    cb = pl.StalwartCallback(session=FakeSession())
    trainer = pl.L.Trainer(accumulate_grad_batches=2, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match="larger batch"):
        cb.setup(trainer, pl.Net(), "fit")


def test_a_shuffling_random_sampler_is_refused_with_the_fix() -> None:
    ds = torch.utils.data.TensorDataset(torch.zeros(8, 4))
    with pytest.raises(ConfigError, match="strategy='ddp'"):
        StepLoader(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))


def test_the_strategy_answers_set_up_collectives_locally_before_the_first_step(
    pl: Any,
) -> None:
    """Lightning's set-up barriers, broadcasts and reductions run before the job's group
    forms (at the first step): answered as if every rank held this one's value."""
    strategy = pl.StalwartStrategy(session=FakeSession())
    strategy.barrier("setup")  # no group: would raise if it reached torch.distributed
    assert strategy.broadcast({"log_dir": "x"}) == {"log_dir": "x"}
    t = torch.tensor([3])
    assert strategy.reduce(t) is t


# ------------------------------------------------------------ epoch-end saves
def test_a_rollback_across_an_epoch_end_redoes_its_checkpoint_save_as_a_replacement_does(
    pl: Any,
) -> None:
    """Step 7 fails just after the epoch-end validation and save of step 6; the rollback
    to 5 redoes step 6 and its save, on this survivor as on a replacement process (a
    fresh ModelCheckpoint): were the survivor to skip it (it saved step 6 already), its
    barriers and broadcasts would be missing on one rank, a collective that never ends."""
    plain_params, plain_saves, plain_scores = pl.fit_saving(None)
    assert plain_saves.steps == [6, 12, 14]
    sess = FakeSession(fail_at={7: 5})
    params, saves, scores = pl.fit_saving(sess)
    assert sess.generation == 1
    assert saves.steps == [6, 6, 12, 14], "the survivor skipped the redone save of step 6"
    assert same_params(params, plain_params) and scores == plain_scores
    # a replacement that resumes after the save holds the callback's state of that step
    seen = FakeSession()
    pl.fit_saving(seen)
    params, saves, scores = pl.fit_saving(_Resumed(seen, 7))
    assert saves.steps == [12, 14], "the replacement did not know step 6 was saved"
    assert same_params(params, plain_params) and scores == plain_scores


def test_a_replaced_rank_0_logs_into_the_runs_version_folder(tmp_path: Any) -> None:
    """A replacement of rank 0 asks its logger for a version again: without the record it
    took the next free ``version_N`` and the run's logs and checkpoints split."""
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    from lightning.pytorch.loggers import CSVLogger

    from stalwart.integrations.lightning import pin_versions

    record = str(tmp_path / "run" / "integrations" / "lightning-versions.json")
    first = CSVLogger(str(tmp_path / "logs"))
    pin_versions([first], record, rank=0)
    assert first.version == 0
    first.log_metrics({"loss": 1.0}, step=1)
    first.save()  # version_0 exists now
    assert CSVLogger(str(tmp_path / "logs")).version == 1  # what a replacement took
    again = CSVLogger(str(tmp_path / "logs"))
    pin_versions([again], record, rank=0)
    assert again.version == 0
    pinned = CSVLogger(str(tmp_path / "logs"), version="mine")
    pin_versions([pinned], record, rank=0)
    assert pinned.version == "mine"  # a version the script chose is its own
