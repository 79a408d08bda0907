"""Nothing stalwart installs leaks into a ``state_dict()``: the optimizer guard (every
strategy) and elastic's live rollback, for every LR scheduler class torch has."""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as S

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.checkpoint._tree import flatten
from stalwart.runtime.elastic._live import LiveRollback
from stalwart.runtime.state._tracking import guard_optimizer


class _Group:
    """What the guard reads from the generation group: the current step's error."""

    error: BaseException | None = None


def _opt() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


Build = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, Build] = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9**e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: S.StepLR(o, 2),
    "MultiStepLR": lambda o: S.MultiStepLR(o, [2, 4]),
    "ConstantLR": lambda o: S.ConstantLR(o),
    "LinearLR": lambda o: S.LinearLR(o),
    "ExponentialLR": lambda o: S.ExponentialLR(o, 0.9),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o), S.ExponentialLR(o, 0.9)], milestones=[3]
    ),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=8),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, 10),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o), S.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=0),
    "CyclicLR": lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=2),
    "OneCycleLR": lambda o: S.OneCycleLR(o, 0.1, total_steps=40),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, 3),
}


def test_every_scheduler_class_of_torch_is_covered() -> None:
    classes = {
        name
        for name, cls in vars(S).items()
        if inspect.isclass(cls)
        and issubclass(cls, S.LRScheduler)
        and cls is not S.LRScheduler
        and not name.startswith("_")
    }
    assert classes - set(SCHEDULERS) == set(), "add the new scheduler classes to SCHEDULERS"


def _step(opt: torch.optim.Optimizer, sched: Any, loss: float) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    if isinstance(sched, S.ReduceLROnPlateau):
        sched.step(loss)
    else:
        sched.step()


def _no_stalwart(obj: Any, path: str = "") -> None:
    """No function, method or object of stalwart anywhere in a state dict."""
    module = getattr(type(obj), "__module__", "") or ""
    assert not module.startswith("stalwart"), f"{path}: {type(obj).__name__} of stalwart"
    assert not isinstance(obj, types.FunctionType | types.MethodType), f"{path}: a function"
    if isinstance(obj, dict):
        for k, v in obj.items():
            _no_stalwart(v, f"{path}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _no_stalwart(v, f"{path}[{i}]")


@pytest.mark.parametrize("before", [True, False], ids=["sched-before-track", "sched-after"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_guards_leave_scheduler_state_alone_and_round_trip(
    name: str, before: bool, tmp_path: Path
) -> None:
    group = _Group()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "optimizer.step() has been overridden"
        opt = _opt()
        if before:
            sched = SCHEDULERS[name](opt)
            guard_optimizer(group, opt)
        else:
            guard_optimizer(group, opt)
            sched = SCHEDULERS[name](opt)
        state = {"optimizer": opt, "scheduler": sched}
        live = LiveRollback(state)  # elastic's
        for i in range(3):
            live.capture(i)
            _step(opt, sched, 1.0)
        for obj in state.values():
            _no_stalwart(obj.state_dict())
        flatten({k: v.state_dict() for k, v in state.items()})  # storable: no function

        snap = Snapshotter(SnapshotConfig("guards", shm_dir=str(tmp_path)))
        try:
            snap.snapshot(state, 3)
            want_sched, want_lr = sched.state_dict(), [g["lr"] for g in opt.param_groups]
            for _ in range(4):
                _step(opt, sched, 2.0)
            assert snap.restore(state) == 3
        finally:
            snap.close(unlink=True)
        assert [g["lr"] for g in opt.param_groups] == want_lr
        assert sched.state_dict() == want_sched

        # a failed step under elastic: the optimizer step is skipped by the guard, the
        # scheduler step (which sets the LR) is undone by the live rollback
        params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        live.capture(3)
        group.error = RuntimeError("a peer died")
        _step(opt, sched, 3.0)
        group.error = None
        assert live.rollback(3)
        assert sched.state_dict() == want_sched
        assert [g["lr"] for g in opt.param_groups] == want_lr
        after = [p.detach() for g in opt.param_groups for p in g["params"]]
        assert all(torch.equal(a, b) for a, b in zip(params, after, strict=True))


def test_guard_skips_the_step_and_is_installed_once() -> None:
    group = _Group()
    opt = _opt()
    guard_optimizer(group, opt)
    guarded = opt.step
    guard_optimizer(group, opt)
    assert opt.step == guarded
    p = opt.param_groups[0]["params"][0]
    before = p.detach().clone()
    group.error = RuntimeError("failed")
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(p.detach(), before)
    group.error = None
    opt.step()
    assert not torch.equal(p.detach(), before)
    assert set(opt.state_dict()) == {"state", "param_groups"}


def test_live_rollback_restores_a_tracked_dict() -> None:
    values = {"best_val_loss": 3.0, "iter_num": 7}
    live = LiveRollback({"meta": values})
    live.capture(7)
    values["best_val_loss"], values["iter_num"], values["new"] = 1.0, 8, True
    assert live.rollback(7)
    assert values == {"best_val_loss": 3.0, "iter_num": 7}
