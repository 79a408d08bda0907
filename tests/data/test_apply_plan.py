"""apply_plan: loaders resharded, learning rates scaled, and both roll back with the state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import TensorDataset

from stalwart.data import BatchConfig, apply_plan, loader, plan_batch
from stalwart.errors import ConfigError

CFG = BatchConfig(global_batch=96, micro_batch=8, policy="nearest")


def _state() -> dict[str, object]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    ld = loader(TensorDataset(torch.arange(200)), batch_size=8, world_size=4, rank=0)
    return {"model": model, "optimizer": opt, "scheduler": sched, "loader": ld}


def test_reshards_loaders_and_scales_the_learning_rate() -> None:
    state = _state()
    opt, sched, ld = state["optimizer"], state["scheduler"], state["loader"]
    assert isinstance(opt, torch.optim.SGD) and isinstance(
        sched, torch.optim.lr_scheduler.LRScheduler
    )
    fields = apply_plan(state, plan_batch(CFG, 5), rank=2)
    # 5 ranks: 3 micro-batches of 6, global 90, lr x 90/96
    assert fields == {
        "world_size": 5,
        "micro_batches": 3,
        "global_batch": 90,
        "lr": pytest.approx(0.1 * 90 / 96),
    }
    assert (ld.world_size, ld.rank, ld.batch_size, ld.micro_batches) == (5, 2, 6, 3)  # type: ignore[attr-defined]
    opt.step()
    sched.step()  # the schedule now produces scaled rates: base 0.09375 x 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 90 / 96 * 0.5)
    apply_plan(state, plan_batch(CFG, 4), rank=0)  # back to a divisor: scale 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5)
    assert sched.base_lrs == [pytest.approx(0.1)]


def test_a_rollback_restores_the_scale_with_the_rates() -> None:
    state = _state()
    opt, sched = state["optimizer"], state["scheduler"]
    assert isinstance(opt, torch.optim.SGD) and isinstance(
        sched, torch.optim.lr_scheduler.LRScheduler
    )
    saved = copy.deepcopy({"opt": opt.state_dict(), "sched": sched.state_dict()})
    apply_plan(state, plan_batch(CFG, 5), rank=0)
    opt.load_state_dict(saved["opt"])  # roll back to before the resize
    sched.load_state_dict(saved["sched"])
    apply_plan(state, plan_batch(CFG, 7), rank=0)  # scale 98/96 of the restored rate
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 98 / 96)


def test_standby_members_do_not_apply_a_plan() -> None:
    plan = plan_batch(BatchConfig(96, 8, policy="compatible"), 5)
    with pytest.raises(ConfigError, match="rank 4 does not train in a world of 4"):
        apply_plan(_state(), plan, rank=4)


def test_a_module_with_a_reshard_method_is_left_alone() -> None:
    """FSDP2 modules have ``reshard()`` (it frees their unsharded parameters): a plan
    reshards loaders, never a module (which would be called with the wrong arguments)."""

    class Fsdpish(torch.nn.Linear):
        def reshard(self) -> None:
            raise AssertionError("a module was resharded by the batch plan")

    state = {**_state(), "model": Fsdpish(2, 1)}
    apply_plan(state, plan_batch(CFG, 4), rank=0)
    assert state["loader"].world_size == 4  # type: ignore[attr-defined]
