"""The resumable, reshardable sampler: which sample indices each rank reads next.

Why the state is *global*: the state is ``(seed, epoch, position)``, where ``position``
counts the samples of the epoch's permutation that the whole job has consumed. It is the
same number on every rank (ranks advance in lockstep, one *round* of
``world_size x batch_size`` samples per micro-batch), so it does not depend on the world
size. After a failure the state rolls back with the rest of the training state; after a
resize the same state is simply read with the new ``(world_size, rank)``: what is left of
the epoch is re-partitioned, and no index of an epoch is read twice or skipped.

A round takes the next ``world_size x batch_size`` indices of the *stream* (the epoch
permutations one after the other); rank ``r`` reads the ``r``-th slice of it. With
``tail="carry"`` (default) the last round of an epoch is completed from the next epoch,
so every batch is full and an optimizer step of ``micro_batches`` rounds reads the same
set of samples whatever the world size (what the constant-global-batch policy needs).
With ``tail="short"`` a round never crosses an epoch: the last one is split as evenly as
possible (a rank may get fewer samples, or none when fewer samples than ranks are left).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from stalwart.errors import ConfigError, StateMismatchError

__all__ = ["SAMPLER_STATE_VERSION", "Round", "SamplerState", "Tail", "epoch_permutation"]

SAMPLER_STATE_VERSION = 1
Tail = Literal["carry", "short"]
_TAILS = ("carry", "short")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, epoch) over the seed space


def epoch_permutation(size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's global order of sample indices (int64), identical on every rank."""
    if not shuffle:
        return torch.arange(size, dtype=torch.int64)
    g = torch.Generator()
    g.manual_seed((seed * _MIX + epoch) % (1 << 63))
    return torch.randperm(size, generator=g, dtype=torch.int64)


@dataclass(frozen=True)
class Round:
    """What one rank reads in one round, and the job's state after the round."""

    indices: list[int]
    epoch: int
    position: int


class SamplerState:
    """``(seed, epoch, position)`` plus the fixed facts the position is relative to.

    Mutable on purpose: :meth:`next_round` is on the training hot path (one call per
    micro-batch) and only does a slice of the cached permutation and integer arithmetic.
    """

    def __init__(
        self,
        size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        tail: Tail = "carry",
        epoch: int = 0,
        position: int = 0,
    ) -> None:
        if size <= 0:
            raise ConfigError(f"dataset has {size} samples; the loader needs at least one")
        if tail not in _TAILS:
            raise ConfigError(f"tail={tail!r}: choose one of {', '.join(_TAILS)}")
        if epoch < 0 or not 0 <= position < size:
            raise ConfigError(f"epoch={epoch}, position={position}: need epoch >= 0, 0 <= pos < n")
        self.size = size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.tail: Tail = tail
        self.epoch = epoch
        self.position = position
        self._perms: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------ the order
    def permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # keep the current and the next epoch only
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = epoch_permutation(self.size, self.seed, epoch, self.shuffle)
        return perm

    def _stream(self, epoch: int, position: int, count: int) -> list[int]:
        """``count`` indices of the stream starting at ``(epoch, position)``."""
        out: list[int] = []
        while count > 0:
            take = min(count, self.size - position)
            out.extend(self.permutation(epoch)[position : position + take].tolist())
            count -= take
            position += take
            if position == self.size:
                epoch, position = epoch + 1, 0
        return out

    def next_round(self, world_size: int, rank: int, batch_size: int) -> Round:
        """This rank's indices for the round at the current state, and the state after
        it (not applied: the caller commits it when the batch is actually consumed)."""
        return self.round_at(self.epoch, self.position, world_size, rank, batch_size)

    def round_at(
        self, epoch: int, position: int, world_size: int, rank: int, batch_size: int
    ) -> Round:
        total = world_size * batch_size
        if self.tail == "short" and self.size - position < total:
            left = self.size - position
            base, extra = divmod(left, world_size)
            start = rank * base + min(rank, extra)
            count = base + (1 if rank < extra else 0)
            return Round(self._stream(epoch, position + start, count), epoch + 1, 0)
        g = position + rank * batch_size
        indices = self._stream(epoch + g // self.size, g % self.size, batch_size)
        e, p = divmod(position + total, self.size)
        return Round(indices, epoch + e, p)

    # ------------------------------------------------------------ the state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able and rank-independent: every rank of a job holds the same dict."""
        return {
            "version": SAMPLER_STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "size": self.size,
            "shuffle": self.shuffle,
            "tail": self.tail,
        }

    def load_state_dict(self, sd: Any) -> None:
        """Take ``(epoch, position)`` from ``sd``; the facts it is relative to (dataset
        size, seed, shuffle, tail) must match this loader's, else the position would
        point into another order."""
        if not isinstance(sd, dict) or sd.get("version") != SAMPLER_STATE_VERSION:
            raise StateMismatchError(
                f"data loader state {sd!r:.120} is not a version-{SAMPLER_STATE_VERSION} "
                "stalwart sampler state; restore a checkpoint written by this version"
            )
        for key in ("size", "seed", "shuffle", "tail"):
            if sd.get(key) != getattr(self, key):
                raise StateMismatchError(
                    f"data loader state has {key}={sd.get(key)!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; build the loader as the saved run did"
                )
        epoch, position = sd.get("epoch"), sd.get("position")
        if not isinstance(epoch, int) or not isinstance(position, int):
            raise StateMismatchError(f"data loader state has no integer epoch/position: {sd!r}")
        if epoch < 0 or not 0 <= position < self.size:
            raise StateMismatchError(
                f"data loader state epoch={epoch}, position={position} is out of range for "
                f"{self.size} samples; the checkpoint is damaged"
            )
        self.epoch, self.position = epoch, position
