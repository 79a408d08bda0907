"""integrations/transformers.py in one process: a real ``transformers.Trainer`` (a tiny
GPT-2 with dropout), a stand-in session that rolls the tracked state back on demand
(tests/integrations/_fake.py), and the final parameters and the loss of every step
compared with the same Trainer run without the callback.

The multi-process runs (a kill, a hang, a long eval under `stalwart run`) are cells of
tests/corpus/test_matrix.py (examples/corpus/hf_trainer.py)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed (Trainer needs it)")

from stalwart.integrations.transformers import (  # noqa: E402
    StalwartCallback,
    TrainerNotFoundError,
)

from ._fake import FakeSession, same_params  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class Copy(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, salt: int) -> None:
        self.n, self.salt = n, salt

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.salt * 1009 + i)
        half = torch.randint(1, 32, (4,), generator=g)
        ids = torch.cat([half, half])
        return {"input_ids": ids, "labels": ids.clone()}


class Losses(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}
        self.evals: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if "loss" in logs:
            self.by_step[state.global_step] = logs["loss"]  # a redone step overwrites
        if "eval_loss" in logs:
            self.evals[state.global_step] = logs["eval_loss"]


def _train(
    sess: FakeSession | None, max_steps: int = 14, accumulation: int = 1
) -> tuple[list[torch.Tensor], Losses]:
    """6 batches an epoch (24 samples, batch 4), a step per ``accumulation`` of them, an
    eval every 4 steps."""
    cb = StalwartCallback(session=sess) if sess is not None else None  # type: ignore[arg-type]
    transformers.set_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=max_steps, per_device_train_batch_size=4,
            per_device_eval_batch_size=4, learning_rate=3e-3, lr_scheduler_type="cosine",
            warmup_steps=2, eval_strategy="steps", eval_steps=4, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
            gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        losses = Losses()
        callbacks = [losses] + ([cb] if cb is not None else [])
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Copy(24, 1), eval_dataset=Copy(8, 2),
            callbacks=callbacks,
        )  # fmt: skip
        trainer.train()
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.fixture(scope="module")
def plain() -> tuple[list[torch.Tensor], Losses]:
    return _train(None)


def test_the_callback_changes_nothing_the_trainer_computes(plain: Any) -> None:
    sess = FakeSession()
    params, losses = _train(sess)
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
    plain: Any, fail_at: dict[int, int]
) -> None:
    sess = FakeSession(fail_at=fail_at)
    params, losses = _train(sess)
    assert sess.generation == len(fail_at), "the rollbacks did not happen"
    assert same_params(params, plain[0]), "final parameters differ from the fault-free Trainer"
    assert losses.by_step == plain[1].by_step, "a redone step's loss differs"
    assert losses.evals == plain[1].evals


def test_a_restored_worker_resumes_at_the_snapshot_without_resume_from_checkpoint(
    plain: Any,
) -> None:
    """A replacement process (or a restart) starts the script again: the session restores
    step 5 at the first step, and the Trainer goes on from there, not from 0."""
    seen = FakeSession()
    _train(seen)  # its step-5 snapshot is what the restored worker finds
    params, losses = _train(_Resumed(seen))
    assert min(losses.by_step) == 6, "the Trainer redid steps the job had done"
    assert same_params(params, plain[0])


class _Resumed(FakeSession):
    """Starts from another run's step-5 snapshot, as a restored worker does."""

    def __init__(self, earlier: FakeSession) -> None:
        super().__init__(start_at=5)
        self.earlier = earlier

    def _snapshot(self, step: int) -> None:
        if step == self.start_at and step not in self.snapshots:
            self.snapshots[step] = self.earlier.snapshots[step]
        else:
            super()._snapshot(step)


def test_a_callback_without_its_trainer_says_how_to_attach_it() -> None:
    cb = StalwartCallback(session=FakeSession())  # type: ignore[arg-type]
    state = transformers.TrainerState()
    with pytest.raises(TrainerNotFoundError, match=r"callbacks=\[\.\.\.\]"):
        cb.on_train_begin(None, state, transformers.TrainerControl())


@pytest.mark.parametrize("accumulation", [2, 3])
def test_with_gradient_accumulation_a_step_is_a_cycle_and_rollbacks_are_bit_identical(
    accumulation: int,
) -> None:
    """The Trainer calls ``on_step_begin`` once per optimizer step (at a cycle's first
    micro-batch): a stalwart step is a whole accumulation cycle, so every snapshot and
    every rollback is at a cycle's end; its re-entry skips the micro-batches of the steps
    done (3 or 2 steps an epoch here)."""
    plain = _train(None, max_steps=8, accumulation=accumulation)
    for fail_at in ({3: 2}, {4: 1}, {6: 3, 8: 7}):
        sess = FakeSession(fail_at=fail_at)
        params, losses = _train(sess, max_steps=8, accumulation=accumulation)
        assert sess.generation == len(fail_at), "the rollbacks did not happen"
        assert same_params(params, plain[0]), f"{fail_at}: final parameters differ"
        assert losses.by_step == plain[1].by_step, f"{fail_at}: a redone step's loss differs"
