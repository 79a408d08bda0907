"""N-D device meshes whose groups follow the generations: HSDP, and FSDP beside TP.

``sess.init_device_mesh((2, 2), ("replicate", "shard"))`` is torch's
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`` for a job run
under stalwart: job ranks laid out row-major (rank = ``i * 2 + j``), and one
:class:`~stalwart.runtime.comm._fsdp.SwapProcessGroup` per dimension whose collectives run on
the current generation's sub-group of that dimension (the
:class:`~stalwart.runtime.comm.group.GenerationGroup` forms the sub-groups at every build,
beside the world's). FSDP2 given a 2-D mesh shards over the last dimension and
replicates over the first (HSDP); DTensor's ``Shard``/``Replicate`` placements (tensor
parallel) take any dimension.

Why the ``replicate`` name matters to recovery: the ranks that differ only in their
``replicate`` coordinate hold the same shards (HSDP's replica groups), so a rank that
lost its memory (its node was lost) can restore them from such a peer's snapshot slots
instead of a disk (:meth:`MeshLayout.copy_key`, runtime/rejoin/_rendezvous.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stalwart.compat.torch_c10d import register_group
from stalwart.errors import ConfigError
from stalwart.runtime.comm._fsdp import SwapProcessGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.runtime.comm.group import GenerationGroup

__all__ = ["REPLICATE", "MeshLayout", "layout_mesh"]

REPLICATE = "replicate"
"""The dimension name whose members hold the same state (HSDP's replica groups)."""


@dataclass(frozen=True)
class MeshLayout:
    """A mesh of the job's ranks, row-major (torch's ``init_device_mesh`` layout)."""

    shape: tuple[int, ...]
    """Members per dimension; their product is the job's world size."""
    names: tuple[str, ...]
    """One unique name per dimension (FSDP2 and DTensor address dimensions by name)."""

    def validate(self, world_size: int) -> None:
        """Raise :class:`ConfigError` naming the fix when the layout cannot hold the job."""
        if len(self.shape) != len(self.names) or not self.shape:
            raise ConfigError(
                f"a device mesh needs one name per dimension: shape {self.shape} with "
                f"names {self.names}; pass as many mesh_dim_names as the shape has sizes"
            )
        if len(set(self.names)) != len(self.names) or any(s < 1 for s in self.shape):
            raise ConfigError(
                f"device mesh {self.shape} {self.names}: names must be unique and sizes "
                ">= 1; rename the dimensions or fix the sizes"
            )
        if math.prod(self.shape) != world_size:
            raise ConfigError(
                f"device mesh {self.shape} holds {math.prod(self.shape)} ranks but the job "
                f"has {world_size}; make the sizes multiply to the world size "
                "(--nnodes x --nproc-per-node)"
            )

    def grid(self) -> torch.Tensor:
        """The job ranks in the mesh's shape (torch's ``mesh`` tensor)."""
        return torch.arange(math.prod(self.shape), dtype=torch.int).reshape(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate in every dimension."""
        out: list[int] = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def dim_ranks(self, rank: int, dim: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim`` (its coordinates elsewhere fixed)."""
        index: list[int | slice] = list(self.coords(rank))
        index[dim] = slice(None)
        return tuple(int(r) for r in self.grid()[tuple(index)].reshape(-1).tolist())

    def copy_key(self, rank: int) -> int | None:
        """Which copy of the state ``rank`` holds: ranks with the same key differ only in
        their ``replicate`` coordinate, so their snapshots are interchangeable (None:
        no ``replicate`` dimension, every rank's state is its own)."""
        if REPLICATE not in self.names:
            return None
        coords = list(self.coords(rank))
        coords[self.names.index(REPLICATE)] = 0
        return int(self.grid()[tuple(coords)].item())


def layout_mesh(gen: GenerationGroup, job: str, layout: MeshLayout) -> DeviceMesh:
    """The CPU ``DeviceMesh`` of ``layout`` whose dimension groups follow the
    generations of ``gen`` (each formed at every build); alone, a mesh of the local
    group. Call before the first step: a dimension's group is formed at a build."""
    from torch.distributed.device_mesh import DeviceMesh

    layout.validate(gen.world_size)
    if gen.world_size == 1:
        world = dist.group.WORLD
        assert world is not None  # runtime/comm/_world.py installed the local group
        alone = [world] * len(layout.shape)
        return DeviceMesh.from_group(alone, "cpu", layout.grid(), mesh_dim_names=layout.names)
    if gen.generation >= 0:
        raise ConfigError(
            "sess.init_device_mesh() was called after the first step: its groups are formed "
            "with the job's; call it before sess.steps() (where torch's init_device_mesh is)"
        )
    groups: list[dist.ProcessGroup] = []
    for dim, name in enumerate(layout.names):
        ranks = layout.dim_ranks(gen.rank, dim)
        key = f"{name}-{'.'.join(map(str, ranks))}"  # the same on every member of it
        gen.add_subgroup(key, ranks)
        pg = SwapProcessGroup(gen, f"stalwart:{job}:{key}", ranks=ranks, sub=key)
        register_group(pg, gen.store, {r: i for i, r in enumerate(ranks)}, "stalwart")
        groups.append(pg)
    return DeviceMesh.from_group(groups, "cpu", layout.grid(), mesh_dim_names=layout.names)
