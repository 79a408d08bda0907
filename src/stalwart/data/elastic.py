"""Apply a :class:`BatchPlan` to a tracked training state after a resize.

One call for the runtime: every tracked object with ``reshard`` (the loader) reads the
rest of the epoch as its new rank, and every tracked optimizer (and LR scheduler) gets
the plan's learning-rate scale.

Why the scale is stored in the optimizer's param groups (``stalwart_lr_scale``): it must
roll back with the state. A rollback to a step before a resize restores the learning
rates of that time; the marker comes back with them, so the next plan scales by
``new / restored`` and scalings never compound or get lost. Schedulers' ``base_lrs``
(and the groups' ``initial_lr``) are scaled by the same ratio, so closed-form schedules
(cosine, step) and chainable ones both produce scaled rates from then on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stalwart.data.batch import BatchPlan
from stalwart.errors import ConfigError

__all__ = ["LR_SCALE_KEY", "apply_plan"]

LR_SCALE_KEY = "stalwart_lr_scale"


def apply_plan(state: Mapping[str, Any], plan: BatchPlan, rank: int) -> dict[str, Any]:
    """Reshard the tracked loaders for ``rank`` of ``plan.world_size`` and scale the
    learning rates; returns the fields of the ``resize`` event (docs/events.md).

    Call it on the ranks that train (``rank < plan.world_size``), after the state was
    restored for the new generation and before its first step."""
    if not 0 <= rank < plan.world_size:
        raise ConfigError(
            f"rank {rank} does not train in a world of {plan.world_size}; "
            "standby members wait for the group to grow instead of applying the plan"
        )
    lr: float | None = None
    ratios: dict[int, float] = {}
    for obj in state.values():
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                ratio = plan.lr_scale / float(group.get(LR_SCALE_KEY, 1.0))
                group[LR_SCALE_KEY] = plan.lr_scale
                group["lr"] = group["lr"] * ratio
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * ratio
                ratios[id(group)] = ratio
                lr = float(group["lr"]) if lr is None else lr
    for obj in state.values():
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            groups = obj.optimizer.param_groups
            obj.base_lrs = [
                b * ratios.get(id(g), 1.0) for b, g in zip(obj.base_lrs, groups, strict=True)
            ]
        # a module's reshard() is another thing: FSDP2's frees its unsharded parameters
        reshard = None if isinstance(obj, torch.nn.Module) else getattr(obj, "reshard", None)
        if callable(reshard):
            reshard(
                world_size=plan.world_size,
                rank=rank,
                batch_size=plan.per_rank_batch,
                micro_batches=plan.micro_batches,
            )
    fields: dict[str, Any] = {
        "world_size": plan.world_size,
        "micro_batches": plan.micro_batches,
        "global_batch": plan.global_batch,
    }
    if lr is not None:  # the first optimizer's first group, as scaled
        fields["lr"] = lr
    return fields
