"""The small ``transformers.Trainer`` hook the callback needs: re-entering the Trainer's
loop at a restored step, in the same process.

The Trainer runs its whole loop inside ``train()``; a callback can stop it, not move it
back. After a recovery the tracked objects (model, optimizer, scheduler, RNGs, the
``TrainerState``) already hold step S; what is left is the Trainer's own loop position.
The Trainer knows how to start from a step: its resume path loads ``trainer_state.json``
from a checkpoint folder, skips the batches of the epoch already trained
(``skip_first_batches``) and loads whatever model, optimizer, scheduler and RNG files the
folder holds. :func:`reenter` gives it a folder with only ``trainer_state.json`` (step S's,
from the tracked state), so it takes the step, the epoch and the data position from it and
loads nothing else: the tensors stay the ones stalwart restored in place. It calls the
Trainer's ``_inner_training_loop`` rather than ``train()``, because ``train()`` insists on
model weights in a resume folder.

Two more things keep a re-entered loop on the same objects: ``create_scheduler`` returns
the tracked scheduler (the loop would otherwise build a new one, whose constructor resets
the optimizer's learning rate), and Accelerate's ``prepare`` of the optimizer and the
already-wrapped DDP model is a no-op the second time (it marks what it prepared).
Tested with transformers 5.24 (docs/integrations.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import TrainOutput

from stalwart.errors import StepFailedError
from stalwart.integrations._steps import Rewind, StepDriver
from stalwart.logs import get_logger

__all__ = ["TrainerStateHolder", "install", "reenter"]

_log = get_logger(__name__)

_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME


class TrainerStateHolder:
    """The ``TrainerState`` (global step, epoch, log history, best metric) as a tracked
    object: snapshotted with the step, restored with it. It is JSON (a string), which a
    checkpoint stores as it is, and per rank (not a replica: the Trainer keeps one on
    every rank)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.restored: str | None = None  # the JSON of the last restore, for reenter()

    def state_dict(self) -> dict[str, Any]:
        # what TrainerState.save_to_json writes
        return {"json": json.dumps(dataclasses.asdict(self._trainer.state), sort_keys=True)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        text = sd["json"]
        if not isinstance(text, str):
            raise TypeError(f"tracked trainer_state holds a {type(text).__name__}, not JSON")
        json.loads(text)  # refuse a malformed one now, not inside the Trainer
        self.restored = text


def reenter(
    trainer: Trainer, holder: TrainerStateHolder, step: int, ignore_keys: list[str] | None
) -> TrainOutput:
    """Run the Trainer's loop again from ``step`` completed steps (the restored state)."""
    if step == 0 or holder.restored is None:
        return trainer._inner_training_loop(
            args=trainer.args, resume_from_checkpoint=None, ignore_keys_for_eval=ignore_keys
        )
    folder = tempfile.mkdtemp(prefix="stalwart-hf-resume-")
    try:
        with open(os.path.join(folder, _STATE_FILE), "w") as f:
            f.write(holder.restored)
        return trainer._inner_training_loop(
            args=trainer.args, resume_from_checkpoint=folder, ignore_keys_for_eval=ignore_keys
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def install(trainer: Trainer, driver: StepDriver, holder: TrainerStateHolder) -> None:
    """Wrap ``trainer.train`` (re-enter after a recovery) and ``trainer.create_scheduler``
    (keep the tracked scheduler) on this Trainer object only; once per Trainer (the
    callback's ``attach`` sees to it)."""
    train: Callable[..., TrainOutput] = trainer.train
    create_scheduler: Callable[..., Any] = trainer.create_scheduler
    kept: list[Any] = []

    def create(num_training_steps: int, optimizer: Any = None) -> Any:
        if kept:
            trainer.lr_scheduler = kept[0]
            return kept[0]
        return create_scheduler(num_training_steps, optimizer)

    def run(*args: Any, **kwargs: Any) -> TrainOutput:
        ignore = kwargs.get("ignore_keys_for_eval")
        call: Callable[[], TrainOutput] = lambda: train(*args, **kwargs)  # noqa: E731
        while True:
            try:
                return call()
            except Rewind as r:
                step = r.step
            except StepFailedError:  # a collective outside the step's compute (eval, log)
                step = driver.recover()
            driver.end_pause()
            if not kept and trainer.lr_scheduler is not None:
                kept.append(trainer.lr_scheduler)
            _log.info("the Trainer's loop resumes from step %d", step)
            call = lambda s=step: reenter(trainer, holder, s, ignore)  # type: ignore[misc]  # noqa: E731

    trainer.train = run  # type: ignore[method-assign]
    trainer.create_scheduler = create  # type: ignore[method-assign]
