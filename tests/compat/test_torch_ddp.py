"""stalwart.compat.torch_ddp against the installed torch: DDP moves onto another group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stalwart.compat import torch_c10d, torch_ddp

from ._seam import relied_on

V = f"torch {torch.__version__}"


def test_ddp_has_its_update_process_group() -> None:
    ddp = torch.nn.parallel.DistributedDataParallel
    relied_on(
        ddp,
        "_update_process_group",
        version=V,
        by="torch_ddp.move_to_group",
        params=["new_process_group"],
    )


@pytest.mark.timeout(120)
def test_a_built_ddp_model_moves_onto_another_group() -> None:
    dist.init_process_group("gloo", store=torch_c10d.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        other = dist.new_group([0], backend="gloo")
        torch_ddp.move_to_group(model, other)
        assert model.process_group is other
        model(torch.ones(1, 2)).sum().backward()  # the reducer runs over the new group
        weight = model.module.weight.grad
        assert weight is not None and weight.tolist() == [[1.0, 1.0]]
    finally:
        dist.destroy_process_group()
