"""Membership of an elastic job: the roster of each generation (docs/elastic.md,
"Membership"). :class:`Roster` is one part of
:class:`~stalwart.runtime.elastic._rejoin.ElasticRejoin`, beside the admission of joiners
(runtime/elastic/_grow.py).

A generation's roster is decided once in the store (``el/roster/<gen>``,
create-if-absent): the previous roster's members that are still alive (the agents keep
``el/alive/<member>`` = incarnation) plus the joiners admitted into that generation.
Every member publishes its info under the generation and the first to see all expected
members arrive writes the roster; everyone reads back the one that won.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from stalwart.coordinator.store import Compare, Put
from stalwart.errors import FencedError, StalwartError
from stalwart.runtime.comm._coord import fence_compares
from stalwart.runtime.elastic._joiners import Keys, alive_members, decode_admit

if TYPE_CHECKING:
    from stalwart.contract.env import WorkerEnv
    from stalwart.coordinator import Coordinator, Store

__all__ = ["Agreed", "ElasticWaitError", "Members", "Roster"]

POLL_S = 0.003

Members = list[tuple[int, str]]
"""(member, incarnation) pairs, in rank order."""

Agreed = tuple[int, Members, dict[int, dict[str, Any]]]
"""(generation, its roster, each member's published info)."""


class ElasticWaitError(StalwartError):
    """The job has fewer members than its minimum and none joined in time."""


class Roster:
    """This member's view of the rosters in the store, and its agreement on the next."""

    def __init__(
        self, store: Store, coord: Coordinator, env: WorkerEnv, keys: Keys, member: int, inc: str
    ) -> None:
        self.store, self.coord, self.env, self.keys = store, coord, env, keys
        self.member, self.inc = member, inc

    def formed_before(self) -> bool:
        """Some generation of this job already formed (a process starting now joins)."""
        return bool(self.store.range(self.keys.roster).kvs)

    # ------------------------------------------------------------ store helpers
    def _roster(self, gen: int) -> Members | None:
        kv = self.store.get(self.keys.gen(self.keys.roster, gen))
        return None if kv is None else [(int(m), str(i)) for m, i in json.loads(kv.value)]

    def _previous_roster(self, gen: int) -> Members | None:
        best: tuple[int, bytes] | None = None
        for kv in self.store.range(self.keys.roster).kvs:
            g = int(kv.key.rsplit("/", 1)[1])
            if g < gen and (best is None or g > best[0]):
                best = (g, kv.value)
        return None if best is None else [(int(m), str(i)) for m, i in json.loads(best[1])]

    def _expected(self, gen: int) -> tuple[Members, int]:
        """Who must take part in ``gen`` (and the least count: the launch size at the
        first formation, when every started member must be in)."""
        store, keys = self.store, self.keys
        alive = alive_members(store, keys)
        prev = self._previous_roster(gen)
        if prev is None:
            return sorted(alive.items()), self.env.world_size
        out = {(m, i) for m, i in prev if alive.get(m) == i}
        kv = store.get(keys.gen(keys.admit, gen))
        admit = decode_admit(None if kv is None else kv.value)
        out |= {k for k in admit if alive.get(k[0]) == k[1]}
        return sorted(out), 0

    def _infos(self, prefix: str) -> dict[int, dict[str, Any]]:
        return {
            int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value)
            for kv in self.store.range(prefix).kvs
        }

    # ------------------------------------------------------------ agreement
    def agree(self, min_generation: int, info: dict[str, Any]) -> Agreed | None:
        """Publish ``info`` in the current generation and wait for its roster; None if
        this process is not in it (a joiner not yet admitted)."""
        deadline = time.monotonic() + self.env.hang_ceiling_s
        while True:
            gen = self.coord.generation()
            if gen < min_generation:
                self.coord.advance_generation(gen, "a member saw a collective fail")
                continue
            moved, found = self._agree_at(gen, info, deadline)
            if not moved:
                return found

    def _agree_at(
        self, gen: int, info: dict[str, Any], deadline: float
    ) -> tuple[bool, Agreed | None]:
        """(False, the roster of ``gen``; None: not in it), or (True, None): the
        generation moved on before it had one."""
        keys, me = self.keys, (self.member, self.inc)
        prefix = keys.gen(keys.info, gen) + "/"
        published = False
        while True:
            roster = self._roster(gen)
            if roster is not None:
                if me not in roster:
                    return False, None
                infos = self._infos(prefix)
                return False, (gen, roster, {m: infos[m] for m, _ in roster})
            expected, least = self._expected(gen)
            if me not in expected:
                return False, None
            if not published:
                self._publish(prefix, gen, info)
                published = True
            have = self._infos(prefix)
            if len(expected) >= least and all(have.get(m, {}).get("inc") == i for m, i in expected):
                key = keys.gen(keys.roster, gen)
                doc = json.dumps([[m, i] for m, i in expected]).encode()
                self.store.txn([Compare(key, "mod_revision", "==", 0)], [Put(key, doc)])
                continue  # read back the roster that won
            if self.coord.generation() != gen:
                return True, None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"generation {gen}: {len(have)} of {len(expected)} members arrived "
                    f"within {self.env.hang_ceiling_s:.0f}s"
                )
            time.sleep(POLL_S)

    def _publish(self, prefix: str, gen: int, info: dict[str, Any]) -> None:
        arrive = Put(self.keys.member(prefix, self.member), json.dumps(info).encode())
        if not self.store.txn(fence_compares(self.env), [arrive]).succeeded:
            raise FencedError(
                f"member {self.member}: this node's agent lost its lease (it was "
                "unresponsive for longer than --node-lease), so this worker stops "
                f"instead of joining generation {gen}"
            )
