"""Replicated state is identical on every member: made so at a fresh start, checked at
every formation.

DDP's constructor broadcasts rank 0's parameters and buffers over its group; under
stalwart it runs before any member is connected (runtime/comm/_world.py), so at the first
formation of a fresh start (nothing restored) the runtime broadcasts rank 0's
parameters and buffers of every tracked DDP model itself. At every formation the
members then all-gather a 64-bit xxh3 digest of those parameters (their bytes in the
model's order, or a sample of 16 MiB of them in a larger model: :func:`digest`) and
refuse to train on when they differ (:class:`ReplicaMismatchError`, naming the ranks).
Buffers are broadcast but not compared: DDP broadcasts them at each forward, which the
local group DDP runs over under stalwart does not, so a buffer that a rank updates on
its own (BatchNorm's running statistics) may legitimately differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import xxhash

from stalwart.errors import ReplicaMismatchError

if TYPE_CHECKING:
    from stalwart.runtime.comm.group import GenerationGroup

__all__ = ["FULL_BYTES", "broadcast_replicas", "check_replicas", "digest", "replicated_modules"]


def replicated_modules(state: Mapping[str, Any]) -> list[torch.nn.Module]:
    """The modules of the tracked DDP models (their state is the same on every rank)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    return [v.module for v in state.values() if isinstance(v, ddp)]


def _tensors(modules: Iterable[torch.nn.Module], buffers: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for m in modules:
        out.extend(p.detach() for p in m.parameters())
        if buffers:
            out.extend(b.detach() for b in m.buffers())
    return out


FULL_BYTES = 16 << 20  # up to this much, every byte is hashed
_CHUNK = 4096


def digest(modules: Iterable[torch.nn.Module], salt: int = 0) -> int:
    """xxh3-64 of the parameters' bytes, in the modules' order, as a signed int64. Past
    :data:`FULL_BYTES` in all, a sample of about that size: every k-th 4 KiB chunk of
    each tensor (plus its tail), starting at chunk ``salt % k``, so that formations of
    successive generations look at different chunks. Replicas that diverged (other
    seeds, other steps) differ in every chunk; a change to a few elements of a large
    model may be missed by one formation's sample."""
    tensors = _tensors(modules, buffers=False)
    total = sum(t.numel() * t.element_size() for t in tensors)
    every = max(1, -(-total // FULL_BYTES))  # ceil
    h = xxhash.xxh3_64()
    for t in tensors:
        data = t.contiguous().view(torch.uint8).numpy().reshape(-1)
        if every == 1 or data.size <= _CHUNK:
            h.update(data.data)
            continue
        whole = data.size // _CHUNK * _CHUNK
        sample = data[:whole].reshape(-1, _CHUNK)[salt % every :: every]
        h.update(sample.copy().data)
        h.update(data[whole:].data)
    return int.from_bytes(h.digest(), "little", signed=True)


def broadcast_replicas(gen: GenerationGroup, modules: list[torch.nn.Module]) -> None:
    """Give every member rank 0's parameters and buffers (one broadcast per dtype);
    raises when a member is lost meanwhile (the formation is then retried)."""
    if gen.pg is None or not modules:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in _tensors(modules, buffers=True):
        by_dtype.setdefault(t.dtype, []).append(t)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        gen.wait(gen.pg.broadcast([flat], opts))
        if gen.rank != 0:
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n


def check_replicas(
    gen: GenerationGroup, modules: list[torch.nn.Module], *, step: int, fresh: bool
) -> None:
    """At a formation: broadcast rank 0's state when ``fresh``, then compare digests;
    raises :class:`ReplicaMismatchError` naming the ranks that differ from rank 0."""
    if gen.pg is None or not modules:
        return
    if fresh:
        broadcast_replicas(gen, modules)
    mine = torch.tensor([digest(modules, salt=gen.generation)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(gen.world_size)]
    gen.wait(gen.pg.allgather([every], [mine]))
    values = [int(t.item()) for t in every]
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        ranks = ", ".join(map(str, differ))
        raise ReplicaMismatchError(
            f"replicated state differs at the formation of generation {gen.generation} "
            f"(step {step}): rank(s) {ranks} hold DDP parameters that differ from rank 0's; "
            "stalwart does not train diverged replicas: a parameter was changed on some "
            "ranks only (outside DDP's gradient averaging) or restored from different "
            "steps; make the change on every rank (or on none), or report the run"
        )
