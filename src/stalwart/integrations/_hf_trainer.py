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
already-wrapped DDP model is a no-op the second time (it marks what it prepared); the
models Accelerate held after the first entry are put back in its list after the
re-entered loop's ``free_memory`` emptied it (else every later eval takes the model for
one evaluated without training and logs ``eval_model_preparation_time``, a column the
earlier evals lack: ``create_model_card`` then fails with a ``KeyError``).

What comes after the loop counts the whole run, not the last entry: the loop's own
totals (the summed loss behind ``train_loss``, the loss not yet logged, the step of the
last log, the FLOPs not yet added to ``total_flos``, the step the run began at and its
start time) are part of the tracked state (:class:`LoopTotals`), put back when the
re-entered loop begins; ``train_runtime`` is measured from the run's first start.
Tested with transformers 5.24 (docs/integrations.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer, TrainerState
from transformers.trainer_utils import TrainOutput

from stalwart.compat import transformers_trainer as hf
from stalwart.errors import StepFailedError
from stalwart.integrations._steps import Finished, Rewind, StepDriver
from stalwart.logs import get_logger

__all__ = ["LoopTotals", "TrainerStateHolder", "finished_output", "install", "reenter"]

_log = get_logger(__name__)

_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME


class LoopTotals:
    """The Trainer loop's running totals that its summary metrics are made of, kept in
    the Trainer's private attributes (transformers 5.24) and reset at every entry of the
    loop: read at a snapshot, put back (:meth:`apply`) when a re-entered loop begins."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.start: float | None = None  # time.time() of the run's first loop entry
        self.closing = False  # in _finalize_training: the unlogged loss is in the total
        self._restored: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        t = self._trainer
        held = hf.read_loop_totals(t)
        tr_loss = held["tr_loss"]
        return {
            "total_loss": float(held["total_loss_scalar"]),
            "tr_loss": float(tr_loss.item())
            if isinstance(tr_loss, torch.Tensor) and not self.closing
            else 0.0,
            "last_logged": int(held["globalstep_last_logged"]),
            "initial_step": int(held["initial_global_step"]),
            "flos": float(t.current_flos),
            "start": self.start,
        }

    def restore(self, values: dict[str, Any]) -> None:
        for key in ("total_loss", "tr_loss", "flos"):
            if not isinstance(values.get(key), float | int):
                raise TypeError(f"tracked trainer_state loop totals: {key!r} is not a number")
        self._restored = values
        if isinstance(values.get("start"), float | int):
            self.start = float(values["start"])

    def began(self) -> None:
        """At ``on_train_begin`` (the loop has just reset its totals): the run's start
        time at its first entry; the restored totals at a re-entry."""
        if self.start is None:
            self.start = time.time()
        self.closing = False
        v, self._restored = self._restored, None
        if v is None:
            return
        t = self._trainer
        hf.write_loop_totals(
            t,
            total_loss=float(v["total_loss"]),
            tr_loss=float(v["tr_loss"]),
            last_logged=int(v["last_logged"]),
            initial_step=int(v["initial_step"]),
        )
        t.current_flos = v["flos"]  # a float once a step ran (typed int: its 0)

    def train_loss(self) -> float:
        """The run's mean loss per step, as ``_finalize_training`` computes it."""
        t = self._trainer
        v = self._restored or self.read()
        steps = t.state.global_step - int(v["initial_step"])
        return (float(v["total_loss"]) + float(v["tr_loss"])) / max(steps, 0.001)


class TrainerStateHolder:
    """The ``TrainerState`` (global step, epoch, log history, best metric) and the loop's
    totals (:class:`LoopTotals`) as a tracked object: snapshotted with the step, restored
    with it. Both are JSON (strings), which a checkpoint stores as they are, and per rank
    (not a replica: the Trainer keeps one on every rank)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.totals = LoopTotals(trainer)
        self.restored: str | None = None  # the JSON of the last restore, for reenter()

    def state_dict(self) -> dict[str, Any]:
        # what TrainerState.save_to_json writes
        state = json.dumps(dataclasses.asdict(self._trainer.state), sort_keys=True)
        return {"json": state, "loop": json.dumps(self.totals.read(), sort_keys=True)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        text = sd["json"]
        if not isinstance(text, str):
            raise TypeError(f"tracked trainer_state holds a {type(text).__name__}, not JSON")
        json.loads(text)  # refuse a malformed one now, not inside the Trainer
        loop = sd.get("loop")  # absent in a checkpoint written before it was tracked
        if isinstance(loop, str):
            values = json.loads(loop)
            if not isinstance(values, dict):
                raise TypeError("tracked trainer_state loop totals are not a JSON object")
            self.totals.restore(values)
        self.restored = text


def reenter(
    trainer: Trainer, holder: TrainerStateHolder, step: int, ignore_keys: list[str] | None
) -> TrainOutput:
    """Run the Trainer's loop again from ``step`` completed steps (the restored state)."""
    if step == 0 or holder.restored is None:
        return hf.inner_training_loop(trainer, None, ignore_keys)  # type: ignore[no-any-return]
    folder = tempfile.mkdtemp(prefix="stalwart-hf-resume-")
    try:
        with open(os.path.join(folder, _STATE_FILE), "w") as f:
            f.write(holder.restored)
        return hf.inner_training_loop(trainer, folder, ignore_keys)  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def finished_output(trainer: Trainer, holder: TrainerStateHolder) -> TrainOutput:
    """What ``train()`` returns when the job had already finished training (a worker
    started again after every member passed the finish barrier): the restored state, no
    step run again."""
    if holder.restored is not None:
        trainer.state = TrainerState(**json.loads(holder.restored))
    loss = holder.totals.train_loss()
    metrics = {"train_loss": loss, "total_flos": trainer.state.total_flos}
    return TrainOutput(trainer.state.global_step, loss, metrics)


def install(trainer: Trainer, driver: StepDriver, holder: TrainerStateHolder) -> None:
    """Wrap ``trainer.train`` (re-enter after a recovery), ``trainer.create_scheduler``
    (keep the tracked scheduler), ``_prepare_for_training`` (keep Accelerate's list of
    prepared models) and ``_finalize_training`` (the run's start time) on this Trainer
    object only; once per Trainer (the callback's ``attach`` sees to it)."""
    train: Callable[..., TrainOutput] = trainer.train
    create_scheduler: Callable[..., Any] = trainer.create_scheduler
    prepare: Callable[..., Any] = hf.prepare_for_training(trainer)
    finalize: Callable[..., TrainOutput] = hf.finalize_training(trainer)
    kept: list[Any] = []
    models: list[Any] = []  # what Accelerate held after the loop's first preparation

    def create(num_training_steps: int, optimizer: Any = None) -> Any:
        if kept:
            trainer.lr_scheduler = kept[0]
            return kept[0]
        return create_scheduler(num_training_steps, optimizer)

    def prepared(*args: Any, **kwargs: Any) -> Any:
        out = prepare(*args, **kwargs)
        held = hf.prepared_models(trainer)
        if not models:
            models.extend(held)
        for m in models:
            if not any(m is h for h in held):
                held.append(m)
        return out

    def finalized(trial: Any, num_train_samples: int, start_time: float) -> TrainOutput:
        start = holder.totals.start
        holder.totals.closing = True  # it adds the unlogged loss to the total first
        return finalize(trial, num_train_samples, start if start is not None else start_time)

    def run(*args: Any, **kwargs: Any) -> TrainOutput:
        ignore = kwargs.get("ignore_keys_for_eval")
        call: Callable[[], TrainOutput] = lambda: train(*args, **kwargs)  # noqa: E731
        while True:
            try:
                return call()
            except Finished:
                return finished_output(trainer, holder)
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
    hf.replace_prepare_for_training(trainer, prepared)
    hf.replace_finalize_training(trainer, finalized)
