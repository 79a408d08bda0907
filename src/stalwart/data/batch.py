"""The global batch policy: what each rank computes when the world size changes.

Why a policy at all: with a constant global batch, an elastic run follows the loss curve
of a fixed-size run (same samples per optimizer step, DESIGN.md §4). Gradient
accumulation absorbs the change: ``global = world x per_rank_batch x micro_batches``.
That only works when the world size divides the global batch; for the other sizes the
user chooses, with one option (``policy``), what happens:

``exact`` (default)
    Every world size the job may run at must divide ``global_batch``; checked up front by
    :meth:`BatchConfig.validate` so that a resize never fails mid-run.
``compatible``
    DeepSpeed-style: the world sizes that keep the global batch are fixed up front (the
    divisors of ``global_batch`` between ``min_world`` and ``max_world``, or an explicit
    ``world_sizes`` list). With another number of members, the largest compatible size
    trains and the others stand by (``standby`` in the plan) until the group grows.
    :func:`compatible_global_batch` picks a global batch with many compatible sizes.
``nearest``
    Every member trains. When the world size does not divide the global batch, each rank
    keeps the number of micro-batches the global batch needs (``ceil(global / (world x
    micro_batch))``) with the per-rank batch rounded to the nearest size, so the global
    batch is the nearest one reachable without extra micro-batches; the learning rate is
    scaled by new/old global batch (``lr_scaling``: linear or sqrt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from stalwart.errors import ConfigError

__all__ = ["BatchConfig", "BatchPlan", "Policy", "compatible_global_batch", "plan_batch"]

Policy = Literal["exact", "compatible", "nearest"]
_POLICIES = ("exact", "compatible", "nearest")


@dataclass(frozen=True)
class BatchPlan:
    """What the runtime applies after a resize (and what the ``resize`` event records)."""

    world_size: int  # members that train (<= the members present under "compatible")
    standby: int  # members present that wait for a compatible size
    per_rank_batch: int  # samples per rank per micro-batch (the loader's batch_size)
    micro_batches: int  # gradient-accumulation steps per optimizer step
    global_batch: int  # world_size x per_rank_batch x micro_batches
    lr_scale: float  # multiply the configured learning rate by this

    def event_fields(self, base_lr: float) -> dict[str, Any]:
        """Fields of the ``resize`` event (docs/events.md) for a configured ``base_lr``."""
        return {
            "world_size": self.world_size,
            "micro_batches": self.micro_batches,
            "lr": base_lr * self.lr_scale,
            "global_batch": self.global_batch,
        }


@dataclass(frozen=True)
class BatchConfig:
    """``global_batch`` samples per optimizer step; ``micro_batch`` is the most samples a
    rank can process at once (memory bound). See the module doc for ``policy``."""

    global_batch: int
    micro_batch: int
    policy: Policy = "exact"
    lr_scaling: Literal["linear", "sqrt"] = "linear"
    world_sizes: tuple[int, ...] | None = None  # "compatible": the allowed sizes

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ConfigError(
                f"global_batch={self.global_batch}, micro_batch={self.micro_batch}: "
                "both must be >= 1"
            )
        if self.policy not in _POLICIES:
            raise ConfigError(f"batch policy {self.policy!r}: choose one of {_POLICIES}")
        if self.lr_scaling not in ("linear", "sqrt"):
            raise ConfigError(f"lr_scaling={self.lr_scaling!r}: choose 'linear' or 'sqrt'")
        for w in self.world_sizes or ():
            if w < 1 or self.global_batch % w:
                raise ConfigError(
                    f"world size {w} in world_sizes does not divide global batch "
                    f"{self.global_batch}; list only divisors of the global batch"
                )

    def compatible_sizes(self, min_world: int, max_world: int) -> list[int]:
        if self.world_sizes is not None:
            return sorted(w for w in self.world_sizes if min_world <= w <= max_world)
        return [w for w in range(min_world, max_world + 1) if self.global_batch % w == 0]

    def validate(self, min_world: int, max_world: int) -> None:
        """Raise ConfigError now for a world-size range this policy cannot serve."""
        if not 1 <= min_world <= max_world:
            raise ConfigError(f"world range {min_world}:{max_world}: need 1 <= MIN <= MAX")
        if self.policy == "exact":
            bad = [w for w in range(min_world, max_world + 1) if self.global_batch % w]
            if bad:
                raise ConfigError(
                    f"global batch {self.global_batch} is not divisible by world size "
                    f"{bad[0]} (allowed {min_world}:{max_world}); choose a global batch "
                    f"divisible by every size, or batch policy 'compatible' or 'nearest'"
                )
        elif self.policy == "compatible" and not self.compatible_sizes(min_world, min_world):
            raise ConfigError(
                f"global batch {self.global_batch} has no compatible world size at the "
                f"minimum {min_world}; the job could not train with {min_world} members: "
                f"raise MIN to a divisor, or choose another global batch"
            )


def _split(per_rank: int, micro_batch: int) -> tuple[int, int]:
    """(per_rank_batch, micro_batches) with the fewest micro-batches that split
    ``per_rank`` samples into equal parts of at most ``micro_batch`` (equal parts keep
    the mean of the micro-batch losses equal to the mean over the global batch)."""
    m = max(1, -(-per_rank // micro_batch))
    while per_rank % m:
        m += 1
    return per_rank // m, m


def plan_batch(config: BatchConfig, members: int, *, min_world: int = 1) -> BatchPlan:
    """The plan for ``members`` ranks present (and a job minimum of ``min_world``)."""
    g = config.global_batch
    if members < 1:
        raise ConfigError(f"{members} members: a batch plan needs at least one")
    if config.policy == "exact":
        if g % members:
            raise ConfigError(
                f"global batch {g} is not divisible by world size {members}; choose batch "
                "policy 'compatible' or 'nearest', or a global batch divisible by it"
            )
        world, new_g = members, g
    elif config.policy == "compatible":
        sizes = config.compatible_sizes(min_world, members)
        if not sizes:
            raise ConfigError(
                f"no world size between {min_world} and {members} divides global batch "
                f"{g}; wait for more members or choose another global batch"
            )
        world, new_g = sizes[-1], g
    elif g % members == 0:  # "nearest", and the size divides: nothing to change
        world, new_g = members, g
    else:  # "nearest": as many micro-batches as the global batch needs, equal parts
        world = members
        m = max(1, -(-g // (world * config.micro_batch)))
        b = min(config.micro_batch, max(1, round(g / (world * m))))
        new_g = world * m * b
    b, m = _split(new_g // world, config.micro_batch)
    ratio = new_g / g
    scale = ratio if config.lr_scaling == "linear" else math.sqrt(ratio)
    return BatchPlan(world, members - world, b, m, new_g, scale)


def compatible_global_batch(
    max_global_batch: int, micro_batches: tuple[int, ...], min_world: int, max_world: int
) -> tuple[int, list[int]]:
    """DeepSpeed-style choice made once before the run: the global batch (at most
    ``max_global_batch``) that the most world sizes in ``min_world..max_world`` can
    serve (the size divides it and the per-rank share is a multiple of one of the
    ``micro_batches`` sizes), the larger batch on a tie; returns it and those sizes (pass
    them as ``BatchConfig(world_sizes=...)``)."""
    if max_global_batch < 1 or not micro_batches or min(micro_batches) < 1:
        raise ConfigError("compatible_global_batch needs max_global_batch >= 1 and micro sizes")
    if not 1 <= min_world <= max_world:
        raise ConfigError(f"world range {min_world}:{max_world}: need 1 <= MIN <= MAX")

    def fits(g: int, w: int) -> bool:
        return g % w == 0 and any((g // w) % mb == 0 for mb in micro_batches)

    best: tuple[int, int] = (0, 0)
    for g in range(1, max_global_batch + 1):
        count = sum(1 for w in range(min_world, max_world + 1) if fits(g, w))
        best = max(best, (count, g))
    if best[0] == 0:
        raise ConfigError(
            f"no global batch <= {max_global_batch} suits world sizes {min_world}:{max_world} "
            f"with micro-batches {micro_batches}; raise max_global_batch"
        )
    g = best[1]
    return g, [w for w in range(min_world, max_world + 1) if fits(g, w)]
