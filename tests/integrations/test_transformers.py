"""integrations/transformers.py in one process: a real ``transformers.Trainer`` (a tiny
GPT-2 with dropout), a stand-in session that rolls the tracked state back on demand
(tests/integrations/_fake.py), and the final parameters and the loss of every step
compared with the same Trainer run without the callback.

The multi-process runs (a kill, a hang, a long eval under `stalwart run`) are cells of
tests/corpus/test_matrix.py (examples/corpus/hf_trainer.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ._fake import FakeSession, same_params

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hf() -> Any:
    """tests/integrations/_hf_fit.py, imported when a test needs it: collecting the suite
    does not import transformers."""
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    pytest.importorskip("accelerate", reason="the [hf] extra is not installed (Trainer needs it)")
    from . import _hf_fit

    return _hf_fit


@pytest.fixture(scope="module")
def plain(hf: Any) -> Any:
    return hf.train(None)


def test_the_callback_changes_nothing_the_trainer_computes(plain: Any, hf: Any) -> None:
    sess = FakeSession()
    params, losses = hf.train(sess)
    assert same_params(params, plain[0])
    assert losses.by_step == plain[1].by_step
    assert sess.yielded == list(range(1, 15))
    logged = [m for m in sess.logged if "loss" in m]
    assert len(logged) == 14 and all("learning_rate" in m for m in logged)
    assert any("eval_loss" in m for m in sess.logged)  # the report's eval curve


@pytest.mark.parametrize(
    "fail_at",
    [
        {5: 3},  # inside an epoch
        {8: 5},  # back across the epoch boundary (6 steps an epoch)
        {2: 0},  # back to step 0
        {4: 3, 9: 8},  # the step of an eval (4, 8) and twice
    ],
    ids=["mid-epoch", "across-epochs", "to-step-0", "eval-steps-twice"],
)
def test_a_rollback_finishes_bit_identical_to_the_plain_trainer(
    plain: Any, hf: Any, fail_at: dict[int, int]
) -> None:
    sess = FakeSession(fail_at=fail_at)
    params, losses = hf.train(sess)
    assert sess.generation == len(fail_at), "the rollbacks did not happen"
    assert same_params(params, plain[0]), "final parameters differ from the fault-free Trainer"
    assert losses.by_step == plain[1].by_step, "a redone step's loss differs"
    assert losses.evals == plain[1].evals


def test_a_restored_worker_resumes_at_the_snapshot_without_resume_from_checkpoint(
    plain: Any, hf: Any
) -> None:
    """A replacement process (or a restart) starts the script again: the session restores
    step 5 at the first step, and the Trainer goes on from there, not from 0."""
    seen = FakeSession()
    hf.train(seen)  # its step-5 snapshot is what the restored worker finds
    params, losses = hf.train(_Resumed(seen))
    assert min(losses.by_step) == 6, "the Trainer redid steps the job had done"
    assert same_params(params, plain[0])


class _Resumed(FakeSession):
    """Starts from another run's step-5 snapshot, as a restored worker does."""

    def __init__(self, earlier: FakeSession, at: int = 5) -> None:
        super().__init__(start_at=at)
        self.earlier = earlier

    def _snapshot(self, step: int) -> None:
        if step == self.start_at and step not in self.snapshots:
            self.snapshots[step] = self.earlier.snapshots[step]
        else:
            super()._snapshot(step)


def test_a_callback_without_its_trainer_says_how_to_attach_it(hf: Any) -> None:
    cb = hf.StalwartCallback(session=FakeSession())
    state = hf.transformers.TrainerState()
    with pytest.raises(hf.TrainerNotFoundError, match=r"callbacks=\[\.\.\.\]"):
        cb.on_train_begin(None, state, hf.transformers.TrainerControl())


@pytest.mark.parametrize("accumulation", [2, 3])
def test_with_gradient_accumulation_a_step_is_a_cycle_and_rollbacks_are_bit_identical(
    accumulation: int, hf: Any
) -> None:
    """The Trainer calls ``on_step_begin`` once per optimizer step (at a cycle's first
    micro-batch): a stalwart step is a whole accumulation cycle, so every snapshot and
    every rollback is at a cycle's end; its re-entry skips the micro-batches of the steps
    done (3 or 2 steps an epoch here)."""
    plain = hf.train(None, max_steps=8, accumulation=accumulation)
    for fail_at in ({3: 2}, {4: 1}, {6: 3, 8: 7}):
        sess = FakeSession(fail_at=fail_at)
        params, losses = hf.train(sess, max_steps=8, accumulation=accumulation)
        assert sess.generation == len(fail_at), "the rollbacks did not happen"
        assert same_params(params, plain[0]), f"{fail_at}: final parameters differ"
        assert losses.by_step == plain[1].by_step, f"{fail_at}: a redone step's loss differs"


@pytest.mark.parametrize(
    ("fail_at", "accumulation", "logging_steps"),
    [({5: 3}, 1, 1), ({4: 3, 9: 8}, 2, 1), ({7: 4}, 1, 3), ({6: 2, 8: 7}, 2, 3)],
    ids=["once", "eval-steps-twice-accumulating", "between-logs", "accumulating-between-logs"],
)
def test_after_rollbacks_what_follows_training_counts_the_whole_run(
    hf: Any, fail_at: dict[int, int], accumulation: int, logging_steps: int
) -> None:
    """train()'s summary (``train_loss``: the mean of every step's loss; ``total_flos``)
    equals the fault-free run's, the evals after a re-entry log the columns the earlier
    ones did (no ``eval_model_preparation_time``), and the model card is written (its
    table needs the same columns in every eval: a ``KeyError`` otherwise)."""
    kw = {"max_steps": 10, "accumulation": accumulation, "logging_steps": logging_steps}
    _, plain = hf.train(None, save_steps=3, **kw)
    sess = FakeSession(fail_at=fail_at)
    _, losses = hf.train(sess, save_steps=3, **kw)
    assert sess.generation == len(fail_at), "the rollbacks did not happen"
    assert losses.summary["train_loss"] == pytest.approx(plain.summary["train_loss"], abs=1e-6)
    assert losses.summary["total_flos"] == plain.summary["total_flos"]
    assert losses.summary["train_steps_per_second"] > 0
    assert losses.eval_keys == plain.eval_keys
    assert losses.by_step == plain.by_step, "a logged loss differs (the unlogged total)"


def test_a_worker_started_after_the_job_finished_runs_no_step(hf: Any) -> None:
    """A worker that joins a job which already trained every step (a relaunch after all
    members passed the finish barrier) gets train()'s result from the restored state,
    not a ``StopIteration`` and not a step run again."""
    seen = FakeSession()
    _, plain = hf.train(seen, max_steps=8)
    again = _Resumed(seen, at=8)
    _, losses = hf.train(again, max_steps=8)
    assert again.yielded == [] and losses.by_step == {}
    assert losses.summary["train_loss"] == pytest.approx(plain.summary["train_loss"], abs=1e-6)
