"""What ``Session.track`` sets up besides recording the state: the rank's checkpoint
manager (snapshot slots, persister, the per-rank part of a replicated state:
runtime/_perrank.py) and the optimizer guard.

Separate from ``track`` because a standby (runtime/_standby.py) records its state at
once but opens its checkpoints only when activated: until then its slots on this host
may still be the live rank's.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

__all__ = ["guard_optimizer", "open_checkpoints"]


def open_checkpoints(sess: Any) -> None:
    """The snapshot slots and the persister of ``sess``'s rank."""
    from stalwart.checkpoint import CheckpointConfig, CheckpointManager, RetentionPolicy
    from stalwart.checkpoint.slots import SlotNames
    from stalwart.runtime._perrank import open_part

    env = sess.env
    run_dir = env.run_dir or os.path.abspath("stalwart-local")
    # replicated (DDP) state: rank 0 persists the one copy; else every rank its own
    own = not sess._replicated and sess.world_size > 1
    root = os.path.join(run_dir, "ckpt", *([f"rank{sess.rank}"] if own else []))
    sess._ckpt = CheckpointManager(
        CheckpointConfig(
            root=root,
            namespace=SlotNames(env.job, env.shm_run).rank(sess.rank),
            rank=0,
            world_size=1,
            retention=RetentionPolicy(env.keep_last, env.keep_every or None),
        )
    )
    for value in sess._state.values():
        if isinstance(value, torch.optim.Optimizer):
            sess._ckpt.snapshots.guard(value)
    if sess._elastic is not None:
        sess._elastic.tracked(sess._state)
    # replicated: every rank persists its per-rank part (RNG, loader, values) beside
    sess._part = open_part(sess, run_dir)
    persists = sess.rank == 0 or not sess._replicated or sess._part is not None
    if env.persist_every != 0 and persists:
        sess._ckpt.persister.start()  # now, not at the first persist (process start)


def guard_optimizer(group: Any, opt: torch.optim.Optimizer) -> None:
    """Skip ``opt.step`` in a step whose collective failed (the step is discarded
    everywhere and redone after the recovery).

    The guard is a method bound to ``opt`` (``__func__`` is what an LR scheduler built
    later wraps) and keeps torch's ``_wrapped_by_lr_sched`` mark when a scheduler built
    earlier had set it: otherwise the scheduler warns that ``optimizer.step()`` was
    overridden after its initialization. Nothing is added to the optimizer's
    ``state_dict()`` (it holds only ``state`` and ``param_groups``)."""
    if getattr(opt.step, _GUARDED, False):
        return  # tracked twice: one guard is enough
    original = opt.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if group.error is not None:
            return None  # the step failed somewhere: discard it everywhere
        return original(*args, **kwargs)

    setattr(step, _GUARDED, True)
    if getattr(original, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]


_GUARDED = "_stalwart_guarded"
