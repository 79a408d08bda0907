"""FSDP2 over a process group that is re-formed per generation.

FSDP2 (``fully_shard``) takes its process group from a ``DeviceMesh`` and keeps it for
the module's lifetime, and ``DeviceMesh.from_group`` only accepts a group registered
with c10d. So :class:`SwapProcessGroup` is one ``ProcessGroup`` object per worker, built
once, registered with c10d under a fixed name, whose collectives run on whatever
``ProcessGroupGloo`` the :class:`~stalwart.runtime.comm.group.GenerationGroup` holds now.
After a failure the session builds the next generation's gloo group and the same FSDP
module, DTensors and optimizer carry on over it.

The group reports the job's rank and size, and since c10d's default group is the job's
(runtime/comm/_world.py: global rank = job rank), its global-to-group rank map is the
identity: ``DeviceMesh.from_group`` computes the right coordinate,
``mesh.get_local_rank()`` is the job rank, and FSDP2 shards accordingly.

Like the DDP hook, a collective never raises: its error is recorded on the generation
group (the optimizer step is skipped, the session discards the step), the group is
dropped so that the peers fail fast too, the outputs are zeroed, and a completed
``Work`` is returned so FSDP2's own state machine (unshard, reshard, reduce-scatter)
finishes the step normally. Collectives run synchronously: on CPU, overlap of FSDP2's
prefetch with compute buys little, and an error must be caught before FSDP2 waits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, ReduceOp, ReduceScatterOptions
from torch.distributed.distributed_c10d import GroupName

from stalwart.compat.torch_c10d import (
    AllgatherOptions,
    allgather_base,
    python_process_group,
    reduce_scatter_base,
    register_group,
    work_from_future,
)
from stalwart.errors import ConfigError, GroupNotFormedError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.contract.env import WorkerEnv
    from stalwart.coordinator import Store
    from stalwart.runtime.comm.group import GenerationGroup

__all__ = [
    "SwapProcessGroup",
    "done_work",
    "generation_mesh",
    "is_sharded",
    "refuse_elastic_mesh",
    "resize_by_restarts",
]


def done_work(result: Any) -> dist.Work:
    """A completed c10d ``Work`` whose result is ``result``."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    work: dist.Work = work_from_future(fut)
    return work


@python_process_group
class SwapProcessGroup(dist.ProcessGroup):
    """A registered ProcessGroup of the job's rank and size whose backend is the
    generation group's current ``ProcessGroupGloo`` (``gen.pg``); with ``sub``, of the
    job ranks ``ranks`` (a mesh dimension's group, runtime/comm/_mesh.py) whose backend is
    the generation's sub-group ``sub`` (``gen.sub(sub)``)."""

    def __init__(
        self,
        gen: GenerationGroup,
        name: str,
        *,
        ranks: Sequence[int] | None = None,
        sub: str | None = None,
    ) -> None:
        rank = gen.rank if ranks is None else list(ranks).index(gen.rank)
        size = gen.world_size if ranks is None else len(ranks)
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._gen = gen
        self._name = GroupName(name)
        self._rank = rank
        self._size = size
        self._sub = sub

    def _comm(self) -> Any:
        """This generation's communicator of the group (None: not formed, or dropped)."""
        return self._gen.pg if self._sub is None else self._gen.sub(self._sub)

    # -- identity -----------------------------------------------------------
    def getBackendName(self) -> str:  # c10d's name
        return "stalwart"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def group_name(self) -> GroupName:
        return self._name

    def __repr__(self) -> str:
        return f"SwapProcessGroup({self._name!r}, rank={self._rank}, size={self._size})"

    # -- the one place collectives run --------------------------------------
    def _run(self, op: Callable[[Any], Any], outputs: Sequence[torch.Tensor]) -> dist.Work:
        """Run ``op(backend)`` and wait; on any error (now or earlier in this step)
        record it, zero ``outputs`` and return a completed Work."""
        gen, comm = self._gen, self._comm()
        if gen.generation < 0 and self._size > 1:
            raise GroupNotFormedError(
                f"a collective on the mesh group {str(self._name)!r} ran before the job's "
                "group formed (members connect at the first `for step in sess.steps(...)` "
                "iteration); its result would be this rank's zeros. Tensor parallel: pass "
                "src_data_rank=None to parallelize_module (every rank seeded alike keeps its "
                "own values); else move the collective into the loop"
            )
        if gen.error is None and comm is not None:
            if gen.on_collective is not None:
                gen.on_collective(True)
            try:
                gen.wait(op(comm))
                return done_work(list(outputs))  # a c10d Work, whatever the backend returned
            except Exception as err:
                gen.error = err.with_traceback(None)  # a traceback keeps frames alive
                gen.drop()  # close our sockets: the other peers fail at once too
            finally:
                if gen.on_collective is not None:
                    gen.on_collective(False)
        elif comm is None and gen.error is None and self._size > 1:
            gen.error = RuntimeError("no process group formed for this generation yet")
        for t in outputs:
            t.zero_()
        return done_work(list(outputs))

    # -- collectives FSDP2, DTensor and functional collectives use ------------
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if isinstance(opts, ReduceOp.RedOpType):
            opts = ReduceOp(opts)
        if opts is None or isinstance(opts, ReduceOp):
            o = AllreduceOptions()
            if opts is not None:
                o.reduceOp = opts
            opts = o
        return self._run(lambda pg: pg.allreduce(tensors, opts), tensors)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        o = opts if opts is not None else AllgatherOptions()
        return self._run(lambda pg: allgather_base(pg, output, input, o), [output])

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        o = opts if opts is not None else ReduceScatterOptions()
        return self._run(lambda pg: reduce_scatter_base(pg, output, input, o), [output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        # gloo has no coalesced form: one all-gather per pair, each recorded like any
        work: dist.Work = done_work(outputs)
        for out, inp in zip(outputs, inputs, strict=True):
            work = self.all_gather_single(out, inp, opts)
        return work

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        work: dist.Work = done_work(outputs)
        for out, inp in zip(outputs, inputs, strict=True):
            work = self.reduce_scatter_single(out, inp, opts)
        return work

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        o = opts if opts is not None else AllgatherOptions()
        flat = [t for ts in outputs for t in ts]
        return self._run(lambda pg: pg.allgather(outputs, inputs, o), flat)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if opts is None:
            opts = dist.BroadcastOptions()
        # a failed broadcast leaves the tensors as they are (not zeroed): they are the
        # root's input on the root, and the step is discarded anyway
        return self._run(lambda pg: pg.broadcast(tensors, opts), [])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        o = opts if opts is not None else dist.ReduceOptions()
        return self._run(lambda pg: pg.reduce(tensors, o), tensors)

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        o = opts if opts is not None else dist.GatherOptions()
        flat = [t for ts in outputs for t in ts]
        return self._run(lambda pg: pg.gather(outputs, inputs, o), flat)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        o = opts if opts is not None else dist.ScatterOptions()
        return self._run(lambda pg: pg.scatter(outputs, inputs, o), outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        o = opts if opts is not None else dist.AllToAllOptions()
        return self._run(
            lambda pg: pg.alltoall_base(output, input, output_split_sizes, input_split_sizes, o),
            [output],
        )

    def barrier(self, opts: Any = None) -> dist.Work:
        o = opts if opts is not None else dist.BarrierOptions()
        return self._run(lambda pg: pg.barrier(o), [])


def generation_mesh(gen: GenerationGroup, job: str) -> DeviceMesh:
    """A 1-D CPU ``DeviceMesh`` over the job's ranks (``mesh_dim_names=("dp",)``) whose
    group follows the generations of ``gen``; alone, the local default group's mesh.
    Under elastic the session first makes the world fixed per launch
    (:func:`resize_by_restarts`): the mesh's size and shards are that launch's."""
    from torch.distributed.device_mesh import DeviceMesh

    if gen.world_size == 1:
        return DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))  # type: ignore[arg-type]
    pg = SwapProcessGroup(gen, f"stalwart:{job}:dp")
    # the job's default group (runtime/comm/_world.py) makes our global rank the job rank
    register_group(pg, gen.store, {i: i for i in range(gen.world_size)}, "stalwart")
    return DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("dp",))


class _Closable(Protocol):
    """The session's elastic rejoin, as far as this module needs it (a Protocol, not
    runtime/comm/_formation.py's ``Rejoin``: it imports this module's parts)."""

    def close(self) -> None: ...


def resize_by_restarts(
    env: WorkerEnv, gen: GenerationGroup, store: Store | None, elastic: _Closable
) -> None:
    """``sess.mesh`` under ``--strategy elastic``: this job's world changes by restarts.

    FSDP2 fixes a module's shards, its all-gather buffers and the optimizer's DTensor
    moments to the mesh it was built on, and torch has no API to rebuild them on a
    smaller one in a live process; elastic's in-place shrink keeps the survivors'
    processes. So a sharded job tells its agent (``el/sharded``), which then starts every
    worker again at the new size on a member's loss or join (agent/strategies/_elastic.py),
    each with its dense rank and the new ``WORLD_SIZE``; the workers restore the newest
    persisted step resharded onto that world (the checkpoint engine re-cuts the DTensor
    pieces) and the loader re-partitions the epoch under the batch policy. Within one
    launch the world is fixed, so the session uses the fixed rejoin, from disk only:
    a snapshot in memory holds the shards of another world size. ``elastic``, the
    elastic rejoin the session opened at start, is closed (the session replaces it)."""
    if gen.generation >= 0:
        raise ConfigError(
            "sess.mesh was first used after the job's group formed under --strategy "
            "elastic; build the FSDP2 model (fully_shard(..., mesh=sess.mesh)) before the "
            "first `for step in sess.steps(...)` iteration"
        )
    if env.nnodes > 1:
        raise ConfigError(
            "FSDP2 (sess.mesh) under --strategy elastic runs on one node for now (its "
            f"workers restart at the new size; this job has {env.nnodes} nodes); use "
            "--strategy flash or spare across nodes, or --nnodes 1"
        )
    if env.persist_every == 0:
        raise ConfigError(
            "FSDP2 (sess.mesh) under --strategy elastic restarts its workers at the new "
            "size from the newest persisted step; pass --persist-every N (or auto)"
        )
    if store is not None:
        from stalwart.coordinator.elastic_keys import Keys

        store.put(Keys(env.job).sharded, b"1")
    gen.signal_slot = False  # no stop vote: a join is a restart, not a step boundary
    elastic.close()


def refuse_elastic_mesh(elastic: bool) -> None:
    """A 2-D mesh (HSDP, tensor parallel) under elastic: its shape is the user's
    ``mesh_shape`` for the launch world, which a resize would not fit: refuse."""
    if elastic:
        raise ConfigError(
            "sess.init_device_mesh (HSDP, tensor parallel) is not supported under "
            "--strategy elastic: its mesh_shape fits one world size; use sess.mesh (FSDP2 "
            "over all ranks: elastic restarts it at the new size), or --strategy flash/spare"
        )


def is_sharded(state: Mapping[str, Any]) -> bool:
    """True when a tracked module holds DTensor parameters (FSDP2, tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(p, DTensor)
        for obj in state.values()
        if isinstance(obj, torch.nn.Module)
        for p in obj.parameters()
    )
