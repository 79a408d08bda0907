"""stalwart.compat.torch_optim against the installed torch: an LR scheduler's mark on
``optimizer.step`` and DCP's lazy optimizer initialisation."""

from __future__ import annotations

import importlib
import types
import warnings
from typing import Any

import torch

from stalwart.compat import torch_optim

from ._seam import changed, relied_on

V = f"torch {torch.__version__}"


def _wrapped(opt: torch.optim.Optimizer, keep: bool) -> None:
    original = opt.step

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    if keep:
        torch_optim.keep_lr_scheduler_mark(original, step)
    opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]


def _overridden_warnings(keep: bool) -> list[str]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    _wrapped(opt, keep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        sched.step()
    return [str(w.message) for w in caught if "overridden" in str(w.message)]


def test_a_guard_that_keeps_the_mark_is_taken_for_the_schedulers_step() -> None:
    assert _overridden_warnings(keep=True) == [], changed(
        "LRScheduler's _wrapped_by_lr_sched mark",
        V,
        "torch_optim.keep_lr_scheduler_mark",
        "no longer silences the overridden-step warning",
    )
    # the check is real: without the mark torch warns
    assert _overridden_warnings(keep=False), changed(
        "LRScheduler.step",
        V,
        "torch_optim.keep_lr_scheduler_mark",
        "no longer warns about an overridden optimizer.step (the mark may be obsolete)",
    )


def test_dcp_initialises_an_optimizer_through_the_named_function() -> None:
    module = importlib.import_module(torch_optim.DCP_STATE_DICT)
    init = relied_on(
        module,
        torch_optim.DCP_INIT_OPTIM_STATE,
        version=V,
        by="torch_optim.DCP_INIT_OPTIM_STATE",
        params=["optim"],
    )
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    init(opt)
    assert opt.state, changed(
        f"{torch_optim.DCP_STATE_DICT}.{torch_optim.DCP_INIT_OPTIM_STATE}",
        V,
        "torch_optim.DCP_INIT_OPTIM_STATE",
        "no longer creates an empty optimizer's state",
    )
