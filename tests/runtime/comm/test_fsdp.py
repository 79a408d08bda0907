"""The FSDP2 process group that follows generations, in one process: rank 1 of a
2-rank job whose generation group is a stub (the multi-process run is in tests/agent)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from stalwart.contract.env import Strategy, WorkerEnv
from stalwart.coordinator.elastic_keys import Keys
from stalwart.coordinator.memory import MemoryStore
from stalwart.errors import ConfigError
from stalwart.runtime.comm._fsdp import (
    SwapProcessGroup,
    generation_mesh,
    is_sharded,
    refuse_elastic_mesh,
    resize_by_restarts,
)
from stalwart.runtime.comm._world import install, uninstall
from stalwart.runtime.comm.group import GenerationGroup


class _Work:
    def __init__(self, err: Exception | None) -> None:
        self.err = err

    def wait(self) -> bool:
        if self.err is not None:
            raise self.err
        return True


class _StubGloo:
    """Plays the other rank: an all-gather puts a copy of our shard in both places, a
    reduce-scatter keeps our chunk doubled; ``fail`` makes every wait raise."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def _work(self) -> _Work:
        return _Work(RuntimeError("Connection closed by peer") if self.fail else None)

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Work:
        self.calls.append("all_gather")
        out.copy_(torch.cat([inp, inp]))
        return self._work()

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Work:
        self.calls.append("reduce_scatter")
        out.copy_(inp.chunk(2)[1] * 2)
        return self._work()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.calls.append("allreduce")
        for t in tensors:
            t.mul_(2)
        return self._work()


@pytest.fixture(scope="module")
def job() -> Iterator[tuple[GenerationGroup, Any]]:
    """One generation group and mesh per process, as in a worker (c10d names are global)."""
    gen = GenerationGroup(("127.0.0.1", 0), 1, 2, 5.0, "fsdp-test", is_master=True)
    install(gen, "fsdp-test")  # the job's default group: global rank 1 of 2
    yield gen, generation_mesh(gen, "fsdp-test")
    gen.close()
    uninstall()


@pytest.fixture
def gen(job: tuple[GenerationGroup, Any]) -> GenerationGroup:
    job[0].pg, job[0].error = None, None
    job[0].generation = 0  # formed (the stubs stand in for its communicator)
    return job[0]


@pytest.fixture
def mesh(job: tuple[GenerationGroup, Any]) -> Any:
    return job[1]


def _sharded(mesh: Any) -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    fully_shard(model, mesh=mesh)
    return model


def test_mesh_has_the_job_rank_and_size(gen: GenerationGroup, mesh: Any) -> None:
    pg = mesh.get_group()
    assert isinstance(pg, SwapProcessGroup)
    assert (mesh.size(), mesh.get_local_rank(), pg.size(), pg.rank()) == (2, 1, 2, 1)
    torch.manual_seed(0)
    full = torch.nn.Linear(4, 6)
    model = _sharded(mesh)
    assert isinstance(model.weight, DTensor)
    assert torch.equal(model.weight.to_local(), full.weight.detach()[3:])  # rank 1's rows


def test_collectives_run_on_the_current_generation(gen: GenerationGroup, mesh: Any) -> None:
    model = _sharded(mesh)
    gen.pg = first = _StubGloo()
    model(torch.ones(2, 4)).sum().backward()
    assert first.calls == ["all_gather", "reduce_scatter"]  # one flat buffer each
    gen.pg = second = _StubGloo()  # the next generation: same module, new group
    model(torch.ones(2, 4)).sum().backward()
    assert second.calls == first.calls and gen.error is None


def test_a_failed_collective_fails_the_step_without_raising(
    gen: GenerationGroup, mesh: Any
) -> None:
    model = _sharded(mesh)
    before = model.weight.to_local().clone()
    stub = _StubGloo(fail=True)
    gen.pg = stub
    out = model(torch.ones(2, 4))  # the all-gather fails: zeroed parameters, no raise
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert isinstance(gen.error, RuntimeError) and gen.pg is None  # group dropped
    assert stub.calls == ["all_gather"]  # nothing more went to the failed group
    assert torch.equal(model.weight.to_local(), before)
    assert gen.reset_step() is not None and gen.error is None


def test_all_reduce_through_the_registered_group(gen: GenerationGroup, mesh: Any) -> None:
    import torch.distributed as dist

    pg = mesh.get_group()
    gen.pg = _StubGloo()
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)
    assert torch.equal(t, torch.full((3,), 2.0))
    gen.pg = None  # no group formed: recorded as a failed step, output zeroed
    dist.all_reduce(t, group=pg)
    assert gen.error is not None and torch.equal(t, torch.zeros(3))


def test_grad_clipping_reduces_through_the_generation(gen: GenerationGroup, mesh: Any) -> None:
    """clip_grad_norm_ on DTensor gradients reduces the norm with a functional collective,
    which c10d resolves by the group's registered name."""
    model = _sharded(mesh)
    gen.pg = stub = _StubGloo()
    model(torch.ones(2, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert stub.calls[-1] == "allreduce" and gen.error is None


class _Gen:
    """What resize_by_restarts reads and sets of a generation group."""

    def __init__(self, generation: int) -> None:
        self.generation, self.signal_slot = generation, True


class _Rejoin:
    closed = False

    def close(self) -> None:
        self.closed = True


def _env(**kw: Any) -> WorkerEnv:
    base: dict[str, Any] = {"job": "shr", "strategy": Strategy.ELASTIC, "persist_every": 5}
    return WorkerEnv(**(base | kw))


def test_under_elastic_the_mesh_tells_the_agent_it_resizes_by_restarts() -> None:
    """The job's store says so (the agent restarts every worker at the new size) and the
    group carries no stop vote (a join is a restart, not a step boundary)."""
    store, group = MemoryStore(), _Gen(-1)
    elastic = _Rejoin()
    resize_by_restarts(_env(), group, store, elastic)  # type: ignore[arg-type]
    assert store.get(Keys("shr").sharded) is not None and not group.signal_slot
    assert elastic.closed


@pytest.mark.parametrize(
    ("env", "generation", "fix"),
    [
        (_env(persist_every=0), -1, "pass --persist-every N"),
        (_env(nnodes=2), -1, "or --nnodes 1"),
        (_env(), 0, "before the first `for step in sess.steps"),
    ],
)
def test_what_resize_by_restarts_cannot_do_is_refused_with_the_fix(
    env: WorkerEnv, generation: int, fix: str
) -> None:
    store = MemoryStore()
    with pytest.raises(ConfigError, match=re.escape(fix)):
        resize_by_restarts(env, _Gen(generation), store, _Rejoin())  # type: ignore[arg-type]
    assert store.get(Keys("shr").sharded) is None


def test_a_2d_mesh_is_refused_under_elastic() -> None:
    with pytest.raises(ConfigError, match="its mesh_shape fits one world size"):
        refuse_elastic_mesh(True)
    refuse_elastic_mesh(False)


def test_a_sharded_state_is_told_from_a_replicated_one(mesh: Any) -> None:
    """A DTensor-parameter module makes the state sharded: every rank persists its
    shard into one multi-rank checkpoint (checkpoint/commit.py)."""
    assert not is_sharded({"model": torch.nn.Linear(4, 6), "meta": {"a": 1}})
    assert is_sharded({"model": _sharded(mesh)})
