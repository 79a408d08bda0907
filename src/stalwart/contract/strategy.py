"""The recovery strategy (``stalwart run --strategy``) as a type, and what it implies.

Re-exported by contract/env.py, the worker contract that carries it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

__all__ = ["STRATEGIES", "Strategy", "replica_group_size"]


class Strategy(str, enum.Enum):
    """A recovery strategy (``stalwart run --strategy``), parsed once from its name.

    Why a type and not the name: what a strategy implies (memory restores, spares, a
    resizing group) is asked of it here, in one place, instead of comparing its name
    wherever it matters. A ``str`` so that events and the contract's JSON carry the
    plain name, as before."""

    RESTART = "restart"
    FLASH = "flash"
    SPARE = "spare"
    ELASTIC = "elastic"
    ASYNC = "async"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # the name's (Enum hashes its member name): a key of "flash"
        return str.__hash__(self)

    @classmethod
    def parse(cls, name: str, error: Callable[[str], Exception]) -> Strategy:
        """The strategy called ``name``; else ``error(message)`` raised, its message
        naming the strategies there are."""
        try:
            return cls(name)
        except ValueError:
            raise error(f"use one of {', '.join(STRATEGIES)}") from None

    @property
    def restores_from_memory(self) -> bool:
        """A failure is recovered from the survivors' memory snapshots (restart: from
        the persisted checkpoint only, as torchrun's jobs do)."""
        return self is not Strategy.RESTART

    @property
    def resizes(self) -> bool:
        """The job goes on with fewer members instead of replacing the lost ones."""
        return self is Strategy.ELASTIC

    @property
    def replaces_in_place(self) -> bool:
        """A lost rank is replaced by a new worker while the others keep their state
        (so a parked standby can stand in for a lost node's ranks)."""
        return self in (Strategy.FLASH, Strategy.SPARE)

    @property
    def syncs_replica_groups(self) -> bool:
        """Replica groups train apart and synchronise every ``--sync-every`` steps
        (LocalSGD / DiLoCo); a failed group is dropped from the rounds, then rejoins."""
        return self is Strategy.ASYNC

    @property
    def uses_spares(self) -> bool:
        """A lost rank is taken over by a pre-started spare worker (``--spares N``)."""
        return self is Strategy.SPARE


def replica_group_size(world_size: int, groups: int) -> int:
    """Workers per replica group of ``--strategy async`` (``groups`` 0: one per worker);
    :class:`~stalwart.errors.ConfigError` when ``groups`` does not divide the workers."""
    from stalwart.errors import ConfigError

    groups = groups or world_size
    if groups > world_size or world_size % groups:
        raise ConfigError(
            f"--replica-groups {groups} does not divide the {world_size} workers: "
            "use a divisor of --nnodes x --nproc-per-node"
        )
    return world_size // groups


STRATEGIES = tuple(s.value for s in Strategy)
"""The recovery strategies' names (``stalwart run --strategy``)."""
