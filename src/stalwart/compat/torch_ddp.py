"""DistributedDataParallel's internals stalwart relies on.

A DDP model is built over the default group before any member of the job is connected;
stalwart moves it onto a local world-size-1 group and runs its gradients through the
generation's comm hook (runtime/comm/_world.py). DDP has no public way to change its group.
tests/compat/test_torch_ddp.py fails when torch changes it. Tested with torch 2.13.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["move_to_group"]


def move_to_group(ddp: torch.nn.parallel.DistributedDataParallel, pg: Any) -> None:
    """Run ``ddp`` over ``pg`` from now on (``DistributedDataParallel.
    _update_process_group(new_process_group)``, which rebuilds its reducer on the new
    group; torch uses it for DDP under a changing world, with no public name)."""
    ddp._update_process_group(pg)  # type: ignore[no-untyped-call]
