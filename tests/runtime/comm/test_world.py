"""The job's default group (runtime/comm/_world.py) in one process: rank 1 of a 2-rank job
whose generation group is a stub playing the other rank; the replica broadcast and
digest (runtime/comm/_replicas.py) over a real gloo group of two threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import HashStore
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.errors import (
    GroupNotFormedError,
    ProcessGroupInitError,
    ReplicaMismatchError,
    StepFailedError,
)
from stalwart.runtime.comm._fsdp import generation_mesh
from stalwart.runtime.comm._replicas import check_replicas, digest
from stalwart.runtime.comm._world import JobProcessGroup, follow, install, localize, uninstall
from stalwart.runtime.comm.group import GenerationGroup

pytestmark = pytest.mark.timeout(120)


class _Work:
    def __init__(self, err: Exception | None) -> None:
        self.err = err

    def wait(self) -> bool:
        if self.err is not None:
            raise self.err
        return True


class _Peer:
    """The other rank of a 2-rank group: an allreduce adds its ``value``."""

    def __init__(self, value: float = 10.0, fail: bool = False) -> None:
        self.value, self.fail = value, fail
        self.calls: list[str] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        self.calls.append("allreduce")
        for t in tensors:
            t.add_(self.value)
        return _Work(RuntimeError("Connection closed by peer") if self.fail else None)

    def barrier(self, opts: Any = None) -> _Work:
        self.calls.append("barrier")
        return _Work(None)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        self.calls.append(f"reduce to {opts.rootRank}")
        return self.allreduce(tensors)


@pytest.fixture
def gen() -> Iterator[GenerationGroup]:
    g = GenerationGroup(("127.0.0.1", 0), 1, 2, 5.0, "world-test", is_master=True)
    install(g, "world-test")
    yield g
    g.close()
    uninstall()


def _form(gen: GenerationGroup, peer: _Peer, generation: int = 0) -> None:
    gen.pg, gen.error, gen.generation = peer, None, generation
    follow(gen)


def test_the_default_group_is_the_jobs(gen: GenerationGroup) -> None:
    assert dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size()) == (1, 2)
    assert isinstance(dist.group.WORLD, JobProcessGroup)
    _form(gen, peer := _Peer())
    t = torch.ones(3)
    dist.all_reduce(t)  # no group=: the job's
    assert torch.equal(t, torch.full((3,), 11.0)) and peer.calls == ["allreduce"]
    dist.barrier()
    dist.reduce(t, dst=0)
    assert peer.calls == ["allreduce", "barrier", "reduce to 0", "allreduce"]


def test_a_collective_before_the_formation_is_refused(gen: GenerationGroup) -> None:
    with pytest.raises(GroupNotFormedError, match=r"sess\.steps"):
        dist.all_reduce(torch.ones(1))


def test_a_barrier_before_the_formation_is_answered_at_once(gen: GenerationGroup) -> None:
    """``training_args.main_process_first()`` (run_clm.py) puts a barrier before step 1:
    it carries no data, so each rank passes it alone; after the formation a barrier is
    the generation's again."""
    dist.barrier()  # no member connected: no wait, no error
    with pytest.raises(GroupNotFormedError):
        dist.broadcast(torch.ones(1), src=0)  # data before the formation: still refused
    _form(gen, peer := _Peer())
    dist.barrier()
    assert peer.calls == ["barrier"]


def test_ddp_is_built_before_the_formation_and_runs_over_a_local_group(
    gen: GenerationGroup,
) -> None:
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))  # its shape check and broadcast answered locally
    assert isinstance(model.process_group, JobProcessGroup)
    localize(model)
    assert model.process_group.size() == 1
    gen.attach(model)
    _form(gen, peer := _Peer(value=0.0))
    for _ in range(3):  # the bucket rebuild (2nd iteration) stays local
        model(torch.ones(2, 4)).sum().backward()
    assert peer.calls == ["allreduce"] * 3 and gen.error is None


def test_a_failed_collective_raises_and_fails_the_step(gen: GenerationGroup) -> None:
    _form(gen, _Peer(fail=True))
    with pytest.raises(StepFailedError, match="a member was lost"):
        dist.all_reduce(torch.ones(2))
    assert gen.pg is None  # dropped: the peers fail fast too
    with pytest.raises(StepFailedError, match="already failed"):
        dist.all_reduce(torch.ones(2))  # nothing returns zeros in a failed step
    assert gen.reset_step() is not None  # what Session.steps() rolls back on


def test_a_collective_after_the_group_was_left_raises(gen: GenerationGroup) -> None:
    _form(gen, _Peer())
    gen.close()  # the generation moved on
    with pytest.raises(StepFailedError, match="generation 0"):
        dist.all_reduce(torch.ones(1))
    assert gen.error is not None


def test_a_second_init_process_group_is_refused(gen: GenerationGroup) -> None:
    with pytest.raises(ProcessGroupInitError, match="remove the call"):
        dist.init_process_group("gloo")
    with pytest.raises(ProcessGroupInitError, match="remove the call"):
        torch.distributed.distributed_c10d.init_process_group("gloo")
    with pytest.raises(ProcessGroupInitError, match="not supported"):
        dist.new_group([0, 1])


def test_a_name_the_script_imported_is_refused_too() -> None:
    script: dict[str, Any] = {"init_process_group": dist.init_process_group}
    g = GenerationGroup(None, 0, 1, 5.0, "world-caller")
    install(g, "world-caller", script)
    try:
        with pytest.raises(ProcessGroupInitError):
            script["init_process_group"]("gloo")
    finally:
        uninstall()
    assert script["init_process_group"] is dist.init_process_group  # restored


def test_an_initialised_default_group_is_refused_at_init() -> None:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        g = GenerationGroup(None, 0, 1, 5.0, "world-twice")
        with pytest.raises(ProcessGroupInitError, match=r"call stalwart.init\(\) first"):
            install(g, "world-twice")
    finally:
        dist.destroy_process_group()


def test_the_default_group_follows_a_resize(gen: GenerationGroup) -> None:
    _form(gen, _Peer())
    first = dist.group.WORLD
    gen.rank, gen.world_size = 2, 3  # elastic: a member joined, we were renumbered
    _form(gen, _Peer(), generation=1)
    world = dist.group.WORLD
    assert world is not first and isinstance(world, JobProcessGroup)
    assert (dist.get_rank(), dist.get_world_size()) == (2, 3)
    assert dist.distributed_c10d._get_group_size_by_name(world.group_name) == 3  # c10d's view
    gen.rank, gen.world_size = 0, 1  # shrank to one: the local group, collectives local
    _form(gen, _Peer(), generation=2)
    assert dist.get_world_size() == 1
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 1.0


def test_alone_the_mesh_is_the_local_group() -> None:
    solo = GenerationGroup(None, 0, 1, 5.0, "fsdp-solo")
    install(solo, "fsdp-solo")
    try:
        from torch.distributed.fsdp import fully_shard

        mesh = generation_mesh(solo, "fsdp-solo")
        assert (mesh.size(), mesh.get_local_rank()) == (1, 0)
        model = torch.nn.Linear(4, 6)
        fully_shard(model, mesh=mesh)
        model(torch.ones(2, 4)).sum().backward()  # runs on the world-size-1 gloo group
        assert model.weight.grad is not None
    finally:
        uninstall()


# ---------------------------------------------------------------- replicas
def _pair() -> list[GenerationGroup]:
    store = HashStore()
    store.set_timeout(timedelta(seconds=60))
    groups = [GenerationGroup(None, r, 2, 60.0, "replica-test", store=store) for r in range(2)]
    _both(lambda g: g.build(0), groups)
    return groups


def _both(fn: Any, groups: list[GenerationGroup]) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None, None]

    def run(i: int) -> None:
        try:
            fn(groups[i])
        except BaseException as err:
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))


def test_a_fresh_start_gives_every_member_rank_0s_state() -> None:
    groups = _pair()
    models = [_model(1337 + r) for r in range(2)]  # seeded per rank, as nanoGPT does
    assert digest([models[0]]) != digest([models[1]])
    models[1][1].running_mean.fill_(5.0)  # a buffer too
    errors = _both(lambda g: check_replicas(g, [models[g.rank]], step=0, fresh=True), groups)
    assert errors == [None, None]
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_diverged_replicas_are_refused_naming_the_ranks() -> None:
    groups = _pair()
    models = [_model(0), _model(0)]
    assert _both(lambda g: check_replicas(g, [models[g.rank]], step=7, fresh=False), groups) == [
        None,
        None,
    ]
    models[1][1].running_var.fill_(3.0)  # buffers may differ (no per-forward broadcast)
    assert _both(lambda g: check_replicas(g, [models[g.rank]], step=7, fresh=False), groups) == [
        None,
        None,
    ]
    with torch.no_grad():
        models[1][0].weight[0, 0] += 1e-6
    errors = _both(lambda g: check_replicas(g, [models[g.rank]], step=7, fresh=False), groups)
    for err in errors:
        assert isinstance(err, ReplicaMismatchError)
        assert "rank(s) 1 " in str(err) and "step 7" in str(err) and "\n" not in str(err)


def test_a_large_model_is_digested_from_a_sample_that_moves_with_the_generation() -> None:
    from stalwart.runtime.comm._replicas import FULL_BYTES

    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(FULL_BYTES // 2))  # 2 x FULL_BYTES: every 2nd chunk
    before = [digest([m], salt=s) for s in (0, 1)]
    with torch.no_grad():
        m.w[1024] = 1.0  # in chunk 1 (4 KiB chunks): salt 1's sample, not salt 0's
    assert digest([m], salt=0) == before[0]
    assert digest([m], salt=1) != before[1]
    other = torch.nn.Module()
    other.w = torch.nn.Parameter(torch.ones(FULL_BYTES // 2))
    assert digest([other], salt=0) != before[0]  # replicas that diverged differ everywhere


def test_a_later_session_of_the_process_replaces_the_earlier_ones_group() -> None:
    first = GenerationGroup(None, 0, 1, 5.0, "world-first")
    install(first, "world-first")
    try:
        second = GenerationGroup(None, 0, 1, 5.0, "world-second")
        install(second, "world-second")  # ours: replaced, not refused
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        uninstall()
    assert not dist.is_initialized()
