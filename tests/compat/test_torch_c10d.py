"""stalwart.compat.torch_c10d against the installed torch: each internal it relies on is
there, and the function built on it does what the runtime needs (one process, a
world-size-1 gloo group)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._C._distributed_c10d as C
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from stalwart.compat import torch_c10d

from ._seam import changed, relied_on

V = f"torch {torch.__version__}"


@pytest.fixture
def world() -> Iterator[Any]:
    """A world-size-1 gloo default group, destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=torch_c10d.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_registry_and_the_private_functions_are_there() -> None:
    w = relied_on(c10d, "_world", version=V, by="torch_c10d.register_group")
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_to_tag", "tags_to_pg"):
        held = relied_on(w, table, version=V, by="torch_c10d.register_group", label="_world")
        assert isinstance(held, dict), changed(f"_world.{table}", V, "register_group", "is no dict")
    relied_on(
        c10d, "_update_default_pg", version=V, by="torch_c10d.set_default_group", params=["pg"]
    )
    relied_on(
        C,
        "_register_process_group",
        version=V,
        by="torch_c10d.register_group",
        params=["group_name", "group"],
    )
    relied_on(
        C,
        "_unregister_process_group",
        version=V,
        by="torch_c10d.forget_group",
        params=["group_name"],
    )
    relied_on(
        C,
        "_create_work_from_future",
        version=V,
        by="torch_c10d.work_from_future",
        params=["future"],
    )
    relied_on(C, "AllgatherOptions", version=V, by="torch_c10d.AllgatherOptions")
    pg = dist.ProcessGroupGloo
    relied_on(pg, "_allgather_base", version=V, by="torch_c10d.allgather_base")
    relied_on(pg, "_reduce_scatter_base", version=V, by="torch_c10d.reduce_scatter_base")


def test_a_work_from_a_future_is_complete_with_its_result() -> None:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    t = torch.ones(2)
    fut.set_result([t])
    work = torch_c10d.work_from_future(fut)
    assert isinstance(work, dist.Work)
    assert work.wait()
    assert work.result()[0] is t


def test_a_registered_group_is_c10ds_until_forgotten(world: Any) -> None:
    gloo = dist.new_group([0], backend="gloo")
    pg = _PyGroup("compat-test:registered")
    torch_c10d.register_group(pg, None, {0: 0}, "stalwart")
    try:
        assert dist.get_process_group_ranks(pg) == [0]
        assert dist.get_rank(pg) == 0
        assert pg in torch_c10d.registered_groups()
        assert c10d._resolve_process_group("compat-test:registered") is pg
    finally:
        torch_c10d.forget_group(pg)
    assert pg not in torch_c10d.registered_groups()
    with pytest.raises(Exception):  # noqa: B017 - torch's own error, by name lookup
        c10d._resolve_process_group("compat-test:registered")
    assert gloo in torch_c10d.registered_groups()


def test_the_default_group_and_its_rank_map_can_be_replaced(world: Any) -> None:
    other = dist.new_group([0], backend="gloo")
    torch_c10d.set_default_group(other)
    try:
        assert dist.group.WORLD is other
        torch_c10d.set_group_ranks(world, {3: 0})
        assert dist.get_process_group_ranks(world) == [3]
    finally:
        torch_c10d.set_group_ranks(world, {0: 0})
        torch_c10d.set_default_group(world)
    assert dist.group.WORLD is world


def test_the_base_collectives_run_on_a_gloo_group(world: Any) -> None:
    inp = torch.arange(3.0)
    out = torch.zeros(3)
    torch_c10d.allgather_base(world, out, inp, torch_c10d.AllgatherOptions()).wait()
    assert out.tolist() == [0.0, 1.0, 2.0]
    scattered = torch.zeros(3)
    opts = dist.ReduceScatterOptions()
    torch_c10d.reduce_scatter_base(world, scattered, inp * 2, opts).wait()
    assert scattered.tolist() == [0.0, 2.0, 4.0]


@torch_c10d.python_process_group
class _PyGroup(dist.ProcessGroup):
    """A Python group that answers c10d's private hooks through its public methods."""

    def __init__(self, name: str) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]
        self._name = name
        self.calls: list[str] = []

    @property
    def group_name(self) -> str:
        return self._name

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        self.calls.append("all_gather")
        out.copy_(inp)
        return _done([out])

    def reduce_scatter_single(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        self.calls.append("reduce_scatter")
        out.copy_(inp)
        return _done([out])

    @property
    def device_types(self) -> list[torch.device]:
        return [torch.device("meta")]  # not torch's default answer (cpu)


def _done(outputs: list[torch.Tensor]) -> Any:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(outputs)
    return torch_c10d.work_from_future(fut)


def test_a_python_group_answers_the_private_hooks_through_its_public_methods(world: Any) -> None:
    assert vars(_PyGroup)["_allgather_base"] is vars(_PyGroup)["all_gather_single"]
    assert vars(_PyGroup)["_reduce_scatter_base"] is vars(_PyGroup)["reduce_scatter_single"]
    pg = _PyGroup("compat-test:hooks")
    torch_c10d.register_group(pg, None, {0: 0}, "stalwart")
    try:
        out = torch.zeros(2)
        torch_c10d.allgather_base(pg, out, torch.ones(2), torch_c10d.AllgatherOptions()).wait()
        assert pg.calls == ["all_gather"] and out.tolist() == [1.0, 1.0]
        # the object collectives ask the group's _device_types (torch's own answer: cpu)
        device = c10d._get_object_coll_device(pg)
        assert device == "meta", changed(
            "c10d._get_object_coll_device",
            V,
            "torch_c10d.python_process_group",
            f"no longer asks the group's _device_types (got {device!r})",
        )
    finally:
        torch_c10d.forget_group(pg)
