"""torch.optim's and torch.distributed.checkpoint's optimizer internals stalwart relies on.

tests/compat/test_torch_optim.py fails, naming the function, when torch changes one.
Tested with torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DCP_INIT_OPTIM_STATE", "DCP_STATE_DICT", "keep_lr_scheduler_mark"]

# torch.distributed.checkpoint.state_dict initialises an optimizer's empty state by
# running a zero step (``_init_optim_state(optim)``) before it reads or loads it; stalwart
# swaps that function while it only looks (checkpoint/_lazy.py) and tells its zero step
# from a real one (agent/processes/_outer_step.py). DCP offers no switch to leave the state empty.
DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"
DCP_INIT_OPTIM_STATE = "_init_optim_state"

# an LR scheduler marks the optimizer's step it wrapped with this attribute, and warns
# that ``optimizer.step()`` was overridden when a later wrapper lacks it
_LR_MARK = "_wrapped_by_lr_sched"


def keep_lr_scheduler_mark(original: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
    """Give ``wrapper`` (a guard around ``optimizer.step``) the mark an LR scheduler
    left on ``original``: torch reads the mark to tell a step it wrapped from one
    replaced since, and has no public way to say a wrapper keeps it."""
    if getattr(original, _LR_MARK, False):
        setattr(wrapper, _LR_MARK, True)
