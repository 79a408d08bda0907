"""The job's generation as a watch delivers it to this agent: its loop's store poll reads
this instead of the store.

The agent's loop looks at the generation at every store poll (ten a second). A read per
look made the generation the largest share of a job's steady store load: at 1,024 nodes,
~10,000 reads a second for a number that changes once per failure (docs/scale.md). The
feed follows the generation key with a watch in a thread of its own
(agent/cluster/_follow.py). A look costs nothing; while no watch is open (the store
away, its history compacted) it says "unknown" and the caller reads the store, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from stalwart.agent.cluster._follow import REREAD_S, WAIT_S, PrefixFollower

__all__ = ["GenerationFeed"]


class GenerationFeed:
    """The generation on the key ``key`` of the store ``store()``, from a watch."""

    def __init__(
        self,
        store: Callable[[], Any],
        key: str,
        *,
        wait_s: float = WAIT_S,
        on_generation: Callable[[int], None] | None = None,
    ) -> None:
        """``on_generation``: called from the watch's thread with each generation it
        delivers (the agent's relay to its workers, agent/cluster/_relay.py)."""
        self._on_generation = on_generation
        self._follower = PrefixFollower(
            store,
            key,
            name="stalwart-genfeed",
            wait_s=wait_s,
            reread_s=REREAD_S,
            on_change=None if on_generation is None else self._delivered,
        )

    def latest(self) -> int | None:
        """The generation the watch carried last (None: unknown, read the store)."""
        kvs = self._follower.snapshot()
        return None if kvs is None else _generation(kvs)

    def _delivered(self, kvs: Mapping[str, bytes]) -> None:
        generation = _generation(kvs)
        if generation is not None and self._on_generation is not None:
            self._on_generation(generation)

    def reason(self, generation: int) -> str | None:
        """Why ``generation`` was set: the bump writes the number and its record
        (``gen_meta``, under the same prefix) in one transaction, so one watch event
        carries both and following a bump needs no read (two a node per failure before)."""
        kvs = self._follower.snapshot()
        if kvs is None or (raw := kvs.get("_meta")) is None:
            return None
        try:
            meta = json.loads(raw)
            if int(meta["generation"]) != generation:
                return None
            return str(meta.get("reason", ""))
        except (ValueError, TypeError, KeyError):
            return None

    def close(self) -> None:
        self._follower.close()


def _generation(kvs: Mapping[str, bytes]) -> int | None:
    try:  # the key itself (the prefix also matches longer names); absent: 0
        return int(kvs.get("", b"0"))
    except ValueError:
        return None
