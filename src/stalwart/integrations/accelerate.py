"""stalwart for a hand-written loop over ``accelerate.Accelerator.prepare``::

    sess = stalwart.init()                                      # before Accelerator()
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(dataloader_config=config)
    model, optimizer, train_dl, sched = accelerator.prepare(model, optimizer, train_dl, sched)
    stalwart_accelerate.track(sess, model=model, optimizer=optimizer, lr_scheduler=sched)
    batch_for = stalwart_accelerate.StepBatches(train_dl)
    for step in sess.steps(total):
        batch = batch_for(step)
        ...                                                     # the loop body, unchanged

Accelerate builds DDP over the job's process group (``stalwart.init()`` first, so that
``Accelerator()`` finds it), its sampler shards the data over the job's ranks, and its
gathers (``gather_for_metrics``) run on the default group. Two things need stalwart's
side: its wrappers (``AcceleratedOptimizer``, ``AcceleratedScheduler``) forward
``step``/``state_dict`` to the torch objects but are not complete ones, so :func:`track`
tracks what they wrap; and a loop driven by ``sess.steps()`` asks for a step's batch, not
the next one (:class:`StepBatches`). With gradient accumulation (a step per micro-batch
under ``accelerator.accumulate(model)``) pass ``accelerator=`` to :func:`track`:
snapshots and rollbacks then land only at the end of a cycle. docs/integrations.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from stalwart.runtime import Session

__all__ = ["Accumulation", "StepBatches", "track"]


def _unwrapped(obj: Any) -> Any:
    """The torch optimizer / LR scheduler inside Accelerate's wrapper, else ``obj``."""
    for attr in ("optimizer", "scheduler"):
        inner = getattr(obj, attr, None)
        if type(obj).__module__.startswith("accelerate.") and inner is not None:
            return inner
    return obj


def track(session: Session, accelerator: Any = None, **state: Any) -> dict[str, Any]:
    """``session.track(**state)`` with Accelerate's optimizer and scheduler wrappers
    replaced by the torch objects they wrap (the wrappers keep forwarding to them, so the
    loop's ``optimizer.step()`` is still skipped in a failed step).

    With gradient accumulation (``Accelerator(gradient_accumulation_steps=k)``, a step per
    micro-batch under ``accelerator.accumulate(model)``) a cycle's partial gradients and
    Accelerate's micro-batch counter are not training state a snapshot can hold: the
    session snapshots, and so rolls back, only at cycle ends (``session.align_steps(k)``),
    and the ``accelerator`` (required then) has its counter tracked and the model's
    gradients dropped on a restore, so a redone cycle starts as the fault-free one did."""
    k = _accumulation_steps(accelerator, state)
    if k > 1:
        if accelerator is None or "model" not in state:
            raise ConfigError(
                f"gradient_accumulation_steps={k}: pass the Accelerator and the model, as "
                "stalwart_accelerate.track(sess, accelerator=accelerator, model=model, ...), "
                "so that a rollback lands at the end of an accumulation cycle"
            )
        session.align_steps(k)
        state["accumulation"] = Accumulation(accelerator, state["model"])
    return session.track(**{name: _unwrapped(obj) for name, obj in state.items()})


def _accumulation_steps(accelerator: Any, state: dict[str, Any]) -> int:
    """The accumulation cycle, from the Accelerator or from a prepared object's
    ``gradient_state`` (Accelerate's one per process)."""
    holders = [accelerator, *state.values()]
    for obj in holders:
        steps = getattr(getattr(obj, "gradient_state", None), "num_steps", None)
        if isinstance(steps, int):
            return steps
    return 1


class Accumulation:
    """Accelerate's micro-batch counter (``Accelerator.step``: ``accumulate()`` syncs and
    steps the optimizer when it reaches a multiple of the cycle) as tracked state. Its
    snapshots are all at cycle ends; restoring one also drops the model's gradients, the
    partial sums of an undone cycle (the fault-free cycle starts from none)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module) -> None:
        self.accelerator, self.model = accelerator, model

    def state_dict(self) -> dict[str, Any]:
        return {"micro_step": int(self.accelerator.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        step = sd["micro_step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise TypeError(f"tracked accumulation holds micro_step={step!r}, not a count")
        self.accelerator.step = step
        self.model.zero_grad(set_to_none=True)


class StepBatches:
    """The batch of step ``n`` of a prepared DataLoader: epoch ``(n - 1) // len`` and the
    batch at ``(n - 1) % len`` in it, as a resumed loop skips the batches already seen.

    The iterator is kept from one step to the next and reopened (``set_epoch``, then
    Accelerate's ``skip_first_batches``) only when the step is not the one after the
    previous call: after a resume or a rollback. The global RNG stream is the plain
    loop's (``for batch in train_dl``): an epoch's iterator is opened at its first step
    and draws what the plain loop's draws there (the port is bit-equal to the script it
    came from); reopened mid-epoch (after a rollback or a resume) it draws nothing
    (``torch.random.fork_rng``): the restored RNGs already hold what the epoch's opening
    drew, so the redone steps draw the dropout masks they drew the first time.

    Refuses a sampler whose order depends on how many epochs this process has iterated
    (Accelerate's default ``RandomSampler`` with a generator it advances): a rolled-back
    or replaced rank would read other samples. ``use_seedable_sampler=True`` seeds each
    epoch from the seed and the epoch."""

    def __init__(self, dataloader: Any) -> None:
        _check_sampler(dataloader)
        _check_cycle(dataloader)
        self.dataloader = dataloader
        self._at: tuple[int, int] | None = None
        self._it: Iterator[Any] | None = None

    def __call__(self, step: int) -> Any:
        epoch, i = divmod(step - 1, len(self.dataloader))
        if self._at != (epoch, i) or self._it is None:
            self._it = self._open(epoch, i)
        self._at = (epoch, i + 1)
        return next(self._it)

    def _open(self, epoch: int, skip: int) -> Iterator[Any]:
        # the first next() runs the iterator's set-up (a seed drawn from the global RNG,
        # Accelerate's generator broadcast): inside the fork too, when mid-epoch
        with torch.random.fork_rng(devices=[], enabled=skip > 0):
            if hasattr(self.dataloader, "set_epoch"):
                self.dataloader.set_epoch(epoch)
            it = itertools.islice(iter(self.dataloader), skip, None)
            first = next(it)
        return itertools.chain([first], it)


def _check_sampler(dataloader: Any) -> None:
    from torch.utils.data import RandomSampler

    seen: list[Any] = []
    obj = getattr(dataloader, "batch_sampler", None)
    while obj is not None and len(seen) < 4:
        seen.append(obj)
        obj = getattr(obj, "batch_sampler", None) or getattr(obj, "sampler", None)
    for s in [*seen, getattr(dataloader, "sampler", None)]:
        if isinstance(s, RandomSampler) and type(s).__name__ != "SeedableRandomSampler":
            raise ConfigError(
                "the prepared DataLoader shuffles with a RandomSampler whose order depends "
                "on the epochs this process iterated, so a recovered rank would read other "
                "samples: build the Accelerator with dataloader_config="
                "DataLoaderConfiguration(use_seedable_sampler=True)"
            )


def _check_cycle(dataloader: Any) -> None:
    """Accelerate ends an accumulation cycle early at an epoch's last batch (and counts
    from 0 again): with epochs of a length that is not a multiple of the cycle, cycle ends
    move from epoch to epoch, and the step count no longer says where a cycle ends."""
    state = getattr(dataloader, "gradient_state", None)
    k = getattr(state, "num_steps", 1)
    if isinstance(k, int) and k > 1 and getattr(state, "sync_with_dataloader", False):
        n = len(dataloader)
        if n % k:
            raise ConfigError(
                f"an epoch of {n} batches is not a whole number of accumulation cycles "
                f"(gradient_accumulation_steps={k}), so cycle ends move from epoch to epoch: "
                f"make it a multiple of {k} (batch size, drop_last) or build the Accelerator "
                "with gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps="
                f"{k}, sync_with_dataloader=False)"
            )
