"""stalwart for a Lightning ``Trainer`` (``lightning.pytorch``): a strategy, two added lines::

    from stalwart.integrations.lightning import StalwartStrategy
    trainer = L.Trainer(strategy=StalwartStrategy(), max_steps=..., callbacks=[...])
    trainer.fit(model, datamodule=dm)              # recovers in place under `stalwart run`

:class:`StalwartStrategy` is Lightning's ``DDPStrategy`` over the job's process group:
building it calls ``stalwart.init()``, so the group exists before ``fit`` sets up DDP and
Lightning reuses it (it finds ``torch.distributed`` initialised and the torchrun
variables `stalwart run` sets). It adds :class:`StalwartCallback` to the Trainer (or
uses the one in ``callbacks=``). Its one change to DDP: the barriers, broadcasts and
reductions Lightning runs while it sets up, before the first step, are answered locally
(as if every rank held this one's value): the job's members connect at the first step
(a replacement worker is alone before it), and they start equal.

What it does, hook by hook:

- ``setup``: installs the hooks of integrations/_pl_loop.py on this Trainer (the fit
  loop re-entered after a rollback, the train DataLoader opened at a step) and adds
  :class:`StalwartLogger` to the Trainer's loggers.
- ``on_train_start``: tracks the DDP model, the optimizers, the LR schedulers, the fit
  loop's counters and the callbacks' state (a ``ModelCheckpoint``'s saves are redone on
  every rank alike; the process RNGs are tracked by the session), then joins the job: a
  replacement worker resumes here from the newest snapshot, with no ``ckpt_path``.
- ``on_train_batch_start``: the stalwart step boundary (integrations/_steps.py): the
  previous step commits and snapshots; a failed one is recovered, and the fit loop is
  re-entered at the restored step. ``global_step`` is stalwart's step count.
- ``on_validation_start`` / ``on_save_checkpoint``: ``sess.pause("eval")`` /
  ``("save")`` until the next step begins: a validation of any length is work.
- :class:`StalwartLogger`: what ``self.log`` logs (``loss``, ``val_loss``, ...) goes to
  ``sess.log`` at Lightning's ``log_every_n_steps``.
- ``on_train_end``: the last step's commit and the job's finish barrier.

docs/integrations.md says what is and is not covered.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy

from stalwart.compat.lightning_trainer import logger_version_unset, set_logger_version
from stalwart.errors import ConfigError
from stalwart.integrations._pl_loop import LoopState, install
from stalwart.integrations._steps import StepDriver

if TYPE_CHECKING:
    from stalwart.runtime import Session

__all__ = ["StalwartCallback", "StalwartLogger", "StalwartStrategy", "pin_versions"]


class StalwartLogger(Logger):
    """A Lightning logger whose metrics go to ``sess.log``: the report's loss curve and
    the NaN/spike detection see what the module logs with ``self.log``."""

    def __init__(self, driver: StepDriver) -> None:
        super().__init__()
        self._driver = driver

    @property
    def name(self) -> str:
        return "stalwart"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {
            k: float(v.item() if isinstance(v, torch.Tensor) else v)
            for k, v in metrics.items()
            if isinstance(v, int | float | torch.Tensor) and not isinstance(v, bool)
        }
        if values and self._driver.started and not self._driver.finished:
            self._driver.session.log(**values)


class StalwartCallback(Callback):
    """Flash/spare recovery for a Lightning ``Trainer`` under `stalwart run`."""

    def __init__(self, session: Session | None = None) -> None:
        if session is None:
            import stalwart

            session = stalwart.init()
        self.session = session
        self._driver = StepDriver(session)
        self._trainer: Trainer | None = None
        self._state: LoopState | None = None

    @property
    def formed(self) -> bool:
        """The job's group formed: the first step began (``sess.steps()``)."""
        return self._driver.started

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._trainer is trainer:
            return
        if self._trainer is not None:
            raise ConfigError(
                "one StalwartCallback serves one Trainer: build a second Trainer with its "
                "own callback only after the first one's fit() returned"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                "StalwartCallback counts a step per batch: accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} is not supported; use a larger batch"
            )
        self._trainer = trainer
        self._state = LoopState(trainer)
        install(trainer, self._driver, self._state)
        trainer.loggers = [*trainer.loggers, StalwartLogger(self._driver)]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._driver.started:
            state: dict[str, Any] = {"model": trainer.strategy.model, "fit_loop": self._state}
            for i, opt in enumerate(trainer.optimizers):
                state["optimizer" if i == 0 else f"optimizer_{i}"] = opt
            for i, config in enumerate(trainer.lr_scheduler_configs):
                state["lr_scheduler" if i == 0 else f"lr_scheduler_{i}"] = config.scheduler
            self.session.track(**state)
            self._driver.start(int(trainer.estimated_stepping_batches))
        self._driver.train_begin(trainer.global_step)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._driver.begin(trainer.global_step)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._driver.started and not self._driver.finished:
            self._driver.pause("eval")

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._driver.started and not self._driver.finished:
            self._driver.pause("save")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._driver.finish(trainer.global_step)


class StalwartStrategy(DDPStrategy):
    """Lightning's DDP over the job's process group, with :class:`StalwartCallback`."""

    def __init__(self, session: Session | None = None, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        self._callback = StalwartCallback(session)

    @property
    def session(self) -> Session:
        return self._callback.session

    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        # set by the Trainer's callback connector: public, untyped
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        run_dir = getattr(getattr(self.session, "env", None), "run_dir", "")
        if run_dir:  # under `stalwart run`: one version folder for the whole run
            record = os.path.join(run_dir, "integrations", "lightning-versions.json")
            pin_versions(trainer.loggers, record, self.global_rank)
        mine = [c for c in callbacks if isinstance(c, StalwartCallback)]
        if not mine:
            callbacks.append(self._callback)
        elif mine[0] is not self._callback:
            self._callback = mine[0]  # the user's, given in callbacks=

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._callback.formed:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return super().broadcast(obj, src) if self._callback.formed else obj

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """A mean is a sum divided here: Lightning asks the group's backend whether it
        averages (gloo does not), and stalwart's group names its own backend, so
        Lightning would ask it for an average of an integer tensor (a batch size)."""
        if not self._callback.formed:
            return tensor
        if isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"):
            return super().reduce(tensor, group, "sum") / self.world_size
        return super().reduce(tensor, group, reduce_op)


def pin_versions(loggers: Sequence[Any], record: str, rank: int) -> None:
    """One ``version_N`` folder per logger for the whole run. A logger without a version
    of its own (``TensorBoardLogger``, ``CSVLogger``: ``version=None``) takes the next
    free ``version_N`` when first asked; a replacement of rank 0 would take the next one
    again, and the run's logs and checkpoints would split across two folders. The first
    rank 0 of the run records the versions it picked in ``record`` (JSON, in the run
    directory); every later worker of the run (a replacement, a restarted job) takes
    them from there."""
    versioned = [(str(i), lg) for i, lg in enumerate(loggers) if _unversioned(lg)]
    if not versioned:
        return
    try:
        with open(record) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict):
        for key, logger in versioned:
            v = saved.get(key)
            if isinstance(v, int | str) and not isinstance(v, bool):
                set_logger_version(logger, v)
        return
    if rank != 0:
        return
    chosen = {key: lg.version for key, lg in versioned}
    os.makedirs(os.path.dirname(record), exist_ok=True)
    with open(record + ".tmp", "w") as f:
        json.dump(chosen, f)
    os.replace(record + ".tmp", record)


def _unversioned(logger: Any) -> bool:
    return logger_version_unset(logger)
