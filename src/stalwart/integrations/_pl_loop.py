"""The small Lightning hooks the callback needs: re-entering ``Trainer.fit``'s loop at a
restored step, in the same process.

Lightning runs its whole loop inside ``fit_loop.run()``; a callback can stop it, not move
it back. After a recovery the tracked objects (model, optimizers, schedulers, RNGs) hold
step S; what is left is the loop's own position: its progress counters and its data
iterator. Lightning's own resume path does the first part: ``fit_loop.load_state_dict``
with the counters of a checkpoint makes the loops "restarting", and ``run()`` then goes
on mid-epoch (no second ``on_train_epoch_start``, the half-fetched batch dropped). The
counters of step S are tracked as :class:`LoopState` (JSON, snapshotted with the step).

The data position is not part of it: Lightning resumes a plain DataLoader mid-epoch at
the epoch's first batch (it warns that the result is "unreliable"). :class:`StepLoader`
wraps the train DataLoader (through the strategy's public ``process_dataloader``) and,
when a rewind asked for it, opens the epoch of step S (``set_epoch``) and skips its
first ``S % len`` batches. Lightning opens the train iterator only at an epoch's start,
so the rewind reopens it (``iter()`` of the fit loop's fetcher: the one private
attribute used, ``_data_fetcher``). Opening it draws nothing from the global RNGs
(``torch.random.fork_rng``). Tested with lightning 2.6 (docs/integrations.md).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stalwart.compat.lightning_trainer import data_fetcher
from stalwart.errors import ConfigError, StepFailedError
from stalwart.integrations._pl_callbacks import callback_states, load_callback_states
from stalwart.integrations._steps import Rewind, StepDriver
from stalwart.logs import get_logger

__all__ = ["LoopState", "StepLoader", "install"]

_log = get_logger(__name__)


class LoopState:
    """The fit loop's progress counters (epoch, batch, optimizer and scheduler steps,
    the validation loop's) and the callbacks' state as a tracked object: JSON, per rank
    (every rank keeps its own loop). Restoring keeps the JSON for the rewind
    (:func:`install`'s wrapper) rather than loading it into the loop at once: the restore
    happens inside a hook of the running loop, whose exit would reset the restart flags
    it sets.

    Why the callbacks: their state decides collectives. ``ModelCheckpoint`` skips a save
    at a step it already saved (``_last_global_step_saved``) and ranks its top-k
    (``best_k_models``); its save runs barriers and broadcasts on every rank. A survivor
    that redoes an epoch's end after a rollback would skip the save that a replacement
    (a fresh callback) runs, and their collectives would never line up again. Restored
    with the step, every rank redoes the same saves."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self.restored: str | None = None
        self.restored_callbacks: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """The counters as at the step boundary: the snapshot is taken at
        ``on_train_batch_start``, after Lightning counted the step's batch as "ready";
        Lightning's restart puts back only the epoch's count of it, not the total one
        (which the validation schedule reads), so the batch is uncounted here, and so is
        its "last batch of the epoch" flag (set again when the batch is fetched again)."""
        sd = self._trainer.fit_loop.state_dict()
        batches = sd.get("epoch_loop.batch_progress", {})
        for part in ("total", "current"):
            tracker = batches.get(part)
            if isinstance(tracker, dict) and "completed" in tracker:
                for key in ("ready", "started", "processed"):
                    tracker[key] = tracker["completed"]
        if "is_last_batch" in batches:
            batches["is_last_batch"] = False
        callbacks = callback_states(self._trainer.callbacks)
        return {"json": json.dumps(sd, sort_keys=True), "callbacks": json.dumps(callbacks)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        text, callbacks = sd["json"], sd.get("callbacks", "{}")  # older: no callbacks
        for what, value in (("loop state", text), ("callback states", callbacks)):
            if not isinstance(value, str) or not isinstance(json.loads(value), dict):
                raise TypeError(f"tracked {what} is not a JSON object")
        self.restored, self.restored_callbacks = text, callbacks


class StepLoader:
    """The train DataLoader, opened at a given epoch and batch after a rewind.

    Forwards everything else (``sampler``, ``batch_sampler``, ``dataset``, ``len``) to
    the DataLoader, so Lightning's ``set_epoch`` and length checks see it unchanged.
    ``state_dict``/``load_state_dict`` make it resumable in Lightning's eyes (its state
    is the step's, which stalwart holds): Lightning then does not warn that a mid-epoch
    resume is unreliable."""

    def __init__(self, dataloader: Any) -> None:
        _check_sampler(dataloader)
        self.dataloader = dataloader
        self._seek: tuple[int, int] | None = None  # (epoch, batches to skip), one use

    def seek(self, epoch: int, skip: int) -> None:
        self._seek = (epoch, skip)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        if self._seek is None:
            return iter(self.dataloader)
        (epoch, skip), self._seek = self._seek, None
        with torch.random.fork_rng(devices=[]):
            set_epoch = getattr(getattr(self.dataloader, "sampler", None), "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            it = itertools.islice(iter(self.dataloader), skip, None)
            try:
                first = next(it)
            except StopIteration:
                return iter(())
        return itertools.chain([first], it)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def _check_sampler(dataloader: Any) -> None:
    """Refuse a sampler whose order depends on the global RNG when an epoch's iterator is
    opened (torch's ``RandomSampler``): a rolled-back or replaced rank would read other
    samples. Lightning's DDP strategy replaces it by a ``DistributedSampler`` seeded per
    epoch; a single-device Trainer keeps it."""
    from torch.utils.data import RandomSampler

    sampler = getattr(dataloader, "sampler", None)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for s in (sampler, getattr(batch_sampler, "sampler", None)):
        if isinstance(s, RandomSampler):
            raise ConfigError(
                "the train DataLoader shuffles with a RandomSampler, whose order is drawn "
                "from the global RNG at each epoch's start, so a recovered rank would read "
                "other samples: run the Trainer with strategy='ddp' (Lightning then shards "
                "with a DistributedSampler seeded per epoch) or give the DataLoader a "
                "DistributedSampler"
            )


def install(trainer: Any, driver: StepDriver, state: LoopState) -> None:
    """Wrap ``trainer.fit_loop.run`` (re-enter after a rewind) and the strategy's
    ``process_dataloader`` (the train DataLoader as a :class:`StepLoader`) on these
    objects only; once per Trainer (the callback sees to it)."""
    loop = trainer.fit_loop
    run: Callable[[], None] = loop.run
    process: Callable[[Any], Any] = trainer.strategy.process_dataloader
    loaders: list[StepLoader] = []

    def process_dataloader(dataloader: Any) -> Any:
        out = process(dataloader)
        if trainer.training and not trainer.sanity_checking:
            out = StepLoader(out)
            loaders[:] = [out]
        return out

    def rerun() -> None:
        while True:
            try:
                return run()
            except Rewind as r:
                step = r.step
            except StepFailedError:  # a collective outside the step's compute (validation)
                step = driver.recover()
            driver.end_pause()
            _log.info("Lightning's fit loop resumes from step %d", step)
            _reposition(trainer, state, loaders, step)

    loop.run = rerun
    trainer.strategy.process_dataloader = process_dataloader


def _reposition(trainer: Any, state: LoopState, loaders: list[StepLoader], step: int) -> None:
    """The loop's counters at ``step`` (the tracked ones) and its train iterator opened
    at that step's epoch and batch."""
    loop = trainer.fit_loop
    if state.restored is not None:
        loop.load_state_dict(json.loads(state.restored))
        state.restored = None
    if state.restored_callbacks is not None:
        load_callback_states(trainer.callbacks, json.loads(state.restored_callbacks))
        state.restored_callbacks = None
    epoch, skip = divmod(step, max(1, int(trainer.num_training_batches)))
    for loader in loaders:
        loader.seek(epoch, skip)
    fetcher = data_fetcher(loop)  # Lightning opens it only at an epoch's start
    if fetcher is not None:
        iter(fetcher)
