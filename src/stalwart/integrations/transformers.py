"""stalwart for ``transformers.Trainer``: a callback, two added lines::

    from stalwart.integrations.transformers import StalwartCallback
    stalwart_cb = StalwartCallback()              # joins the job: before TrainingArguments
    ...
    trainer = Trainer(model=..., args=..., callbacks=[stalwart_cb])
    trainer.train()                               # recovers in place under `stalwart run`

What it does, hook by hook:

- ``on_init_end``: finds the Trainer that is being built and installs the hook of
  integrations/_hf_trainer.py on it (``train`` re-enters the loop after a recovery).
- ``on_train_begin``: tracks the DDP model (``trainer.model_wrapped``), the optimizer, the
  scheduler and the ``TrainerState`` (the process RNGs are tracked by the session), then
  joins the job: a replacement worker, or a whole job restarted under ``restart``,
  resumes here from the newest snapshot or checkpoint, with no ``resume_from_checkpoint``.
  A re-entered loop gets its running totals back here (``train_loss``, ``total_flos``
  and ``train_runtime`` count the whole run; integrations/_hf_trainer.py).
- ``on_step_begin``: the stalwart step boundary (integrations/_steps.py): the previous
  step commits and snapshots; a failed step recovers, and the Trainer's loop is re-entered
  at the restored step. ``global_step`` is stalwart's step count.
- ``on_step_end`` / ``on_epoch_end``: when the Trainer is about to evaluate or save,
  ``sess.pause("eval")`` / ``("save")`` until the next step begins: an eval of any length
  is work, never a hang.
- ``on_log``: the Trainer's logs (``loss``, ``eval_loss``, ``learning_rate``,
  ``grad_norm``, ...) go to ``sess.log``: the report's loss curve and the NaN/spike
  detection see them.
- ``on_train_end``: the last step's commit and the job's finish barrier.

docs/integrations.md says what is and is not covered.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stalwart.errors import StalwartError
from stalwart.integrations._hf_trainer import TrainerStateHolder, install
from stalwart.integrations._steps import StepDriver

if TYPE_CHECKING:
    from stalwart.runtime import Session

__all__ = ["StalwartCallback", "TrainerNotFoundError"]

_FRAMES = 8  # how far up on_init_end looks for the Trainer being built


class TrainerNotFoundError(StalwartError, RuntimeError):
    """The callback was not given to a ``Trainer`` (or the Trainer could not be found)."""


class StalwartCallback(TrainerCallback):
    """Flash/spare/elastic recovery for a ``transformers.Trainer``.

    Build it before ``TrainingArguments``: it calls ``stalwart.init()``, which must run
    before anything initialises ``torch.distributed`` (``TrainingArguments`` does, through
    Accelerate), so that the Trainer and Accelerate reuse the job's process group."""

    def __init__(self, session: Session | None = None) -> None:
        if session is None:
            import stalwart

            session = stalwart.init()
        self.session = session
        self._driver = StepDriver(session)
        self._trainer: Trainer | None = None
        self._holder: TrainerStateHolder | None = None

    def attach(self, trainer: Trainer) -> None:
        """Install the Trainer hook (done by ``on_init_end`` when the callback was given
        to the Trainer's constructor; call it for a callback added later)."""
        if self._trainer is trainer:
            return
        if self._trainer is not None and self._trainer is not trainer:
            raise TrainerNotFoundError(
                "one StalwartCallback serves one Trainer: build a second Trainer with its "
                "own callback only after the first one's train() returned"
            )
        self._trainer = trainer
        self._holder = TrainerStateHolder(trainer)
        install(trainer, self._driver, self._holder)

    # ------------------------------------------------------------ hooks
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_FRAMES):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                self.attach(owner)
                return
            frame = frame.f_back

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        trainer = self._trainer
        if trainer is None or self._holder is None:
            raise TrainerNotFoundError(
                "StalwartCallback did not find its Trainer: pass it to Trainer(callbacks=[...]) "
                "or call callback.attach(trainer) before trainer.train()"
            )
        if not self._driver.started:
            self._holder.totals.began()  # the run's start time (a restore overwrites it)
            self.session.track(
                model=trainer.model_wrapped,
                optimizer=_unwrapped(trainer.optimizer),
                lr_scheduler=trainer.lr_scheduler,
                trainer_state=self._holder,
            )
            self._driver.start(state.max_steps)
        self._driver.train_begin(state.global_step)
        self._holder.totals.began()  # a re-entered loop: its totals as they were at the step

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._driver.begin(state.global_step)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._pause_for(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._pause_for(control)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        values = {
            k: v
            for k, v in (logs or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if values and self._driver.started and not self._driver.finished:
            self.session.log(**values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._driver.finish(state.global_step)

    def _pause_for(self, control: TrainerControl) -> None:
        if control.should_evaluate:
            self._driver.pause("eval")
        elif control.should_save:
            self._driver.pause("save")


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (which forwards
    ``step`` and ``state_dict`` to it but is not a complete ``torch.optim.Optimizer``: it
    has no step hooks of its own)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
