"""The N-D mesh (HSDP): its layout, its dimension groups formed per generation, and the
restore point a lost replica group's ranks agree on (their shards from the other
group's memory). In one process with a fake backend; the 2-node run is in tests/agent."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import HashStore

from stalwart.errors import ConfigError
from stalwart.runtime.comm._fsdp import SwapProcessGroup
from stalwart.runtime.comm._mesh import MeshLayout, layout_mesh
from stalwart.runtime.comm._world import install, uninstall
from stalwart.runtime.comm.group import GenerationGroup
from stalwart.runtime.rejoin._fixed import peer_rank
from stalwart.runtime.rejoin._rendezvous import Agreement, choose

HSDP = MeshLayout((2, 2), ("replicate", "shard"))


def test_layout_is_row_major_and_replicas_share_a_copy_key() -> None:
    assert [HSDP.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert HSDP.dim_ranks(1, 0) == (1, 3)  # rank 1's replicate group
    assert HSDP.dim_ranks(1, 1) == (0, 1)  # its shard group
    assert [HSDP.copy_key(r) for r in range(4)] == [0, 1, 0, 1]
    tp = MeshLayout((2, 3), ("shard", "tp"))
    assert tp.copy_key(4) is None  # no replicate dimension: every rank's state is its own
    assert tp.dim_ranks(4, 1) == (3, 4, 5)


@pytest.mark.parametrize(
    ("shape", "names", "why"),
    [
        ((2, 2), ("replicate",), "one name per dimension"),
        ((2, 2), ("a", "a"), "unique"),
        ((2, 3), ("replicate", "shard"), "job has 4"),
    ],
)
def test_a_layout_that_cannot_hold_the_job_is_refused(
    shape: tuple[int, ...], names: tuple[str, ...], why: str
) -> None:
    with pytest.raises(ConfigError, match=why):
        MeshLayout(shape, names).validate(4)


class _Comm:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.ops = rank, size, 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        from stalwart.runtime.comm._fsdp import done_work

        self.ops += 1
        return done_work(tensors)


class _Backend:
    """Records the communicators a build forms (rank and size of each)."""

    name = "gloo"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.made: list[_Comm] = []

    def create(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        self.made.append(_Comm(rank, world_size))
        return self.made[-1]

    def allreduce(self, comm: Any, tensors: list[torch.Tensor], timeout: timedelta) -> Any:
        return comm.allreduce(tensors, None)

    def abandon(self, comm: Any, work: Any) -> None:
        pass

    def drop(self, comm: Any) -> None:
        pass

    def at_exit(self) -> None:
        pass


@pytest.fixture(scope="module")
def job() -> Iterator[tuple[GenerationGroup, _Backend, Any]]:
    backend = _Backend()
    gen = GenerationGroup(None, 1, 4, 5.0, "mesh-test", store=HashStore(), backend=backend)
    install(gen, "mesh-test")  # the job's default group: global rank 1 of 4
    yield gen, backend, layout_mesh(gen, "mesh-test", HSDP)
    gen.close()
    uninstall()


def test_each_dimension_runs_on_its_own_sub_group_of_the_generation(
    job: tuple[GenerationGroup, _Backend, Any],
) -> None:
    gen, backend, mesh = job
    assert mesh.shape == (2, 2) and mesh.mesh_dim_names == ("replicate", "shard")
    rep, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    assert isinstance(rep, SwapProcessGroup) and (rep.rank(), rep.size()) == (0, 2)
    assert (shard.rank(), shard.size(), mesh.get_local_rank("shard")) == (1, 2, 1)
    gen.build(0)
    world, sub_rep, sub_shard = backend.made[-3:]
    assert [(c.rank, c.size) for c in (world, sub_rep, sub_shard)] == [(1, 4), (0, 2), (1, 2)]
    rep.allreduce([torch.ones(2)]).wait()
    assert (world.ops, sub_rep.ops, sub_shard.ops) == (0, 1, 0)
    gen.build(1)  # the next generation forms new sub-groups; the mesh follows them
    rep.allreduce([torch.ones(2)]).wait()
    assert backend.made[-2].ops == 1 and sub_rep.ops == 1


def test_a_collective_before_the_first_formation_is_refused_not_zeroed() -> None:
    """Tensor parallel's parallelize_module scatters rank 0's weights at once by default:
    before the formation no member is connected, so the result would be zeros."""
    from stalwart.errors import GroupNotFormedError

    backend = _Backend()
    gen = GenerationGroup(None, 0, 2, 5.0, "early", store=HashStore(), backend=backend)
    pg = SwapProcessGroup(gen, "stalwart:early:tp", ranks=(0, 1), sub="tp-0.1")
    with pytest.raises(GroupNotFormedError, match="src_data_rank=None"):
        pg.allreduce([torch.ones(2)])
    gen.close()


def test_the_mesh_must_be_made_before_the_first_step(
    job: tuple[GenerationGroup, _Backend, Any],
) -> None:
    gen = job[0]
    if gen.generation < 0:  # whatever ran first in this module: the first step happened
        gen.build(0)
    with pytest.raises(ConfigError, match=r"before sess\.steps"):
        layout_mesh(gen, "mesh-test", HSDP)


def _infos(
    lost: tuple[int, ...], copy: bool = True, hosts: tuple[str, ...] = ()
) -> list[dict[str, object]]:
    host = socket.gethostname()
    return [
        {
            "rank": r,
            "steps": [] if r in lost else [40, 60],
            "host": hosts[r] if hosts else host,
            **({"copy": HSDP.copy_key(r)} if copy else {}),
        }
        for r in range(4)
    ]


def test_a_lost_replica_group_restores_from_the_other_groups_memory() -> None:
    infos = _infos(lost=(2, 3))
    assert choose(infos, 20, use_memory=True) == (60, "peer")
    a = Agreement(3, 60, "peer", 61, tuple(infos))
    assert [peer_rank(a, r) for r in (2, 3)] == [0, 1]  # the same shards


def test_without_a_copy_of_the_lost_shards_in_memory_it_is_the_disk() -> None:
    assert choose(_infos(lost=(2, 3), copy=False), 20, use_memory=True) == (20, "disk")
    assert choose(_infos(lost=(1, 3)), 20, use_memory=True) == (
        20,
        "disk",
    )  # both copies of shard 1
    other = ("a", "a", "b", "b")  # the holders are on another host: not readable here
    assert choose(_infos(lost=(2, 3), hosts=other), 20, use_memory=True) == (20, "disk")
