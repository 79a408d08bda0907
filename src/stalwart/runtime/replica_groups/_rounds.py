"""The synchronisation rounds of ``--strategy async`` in the coordinator's store.

Round ``r`` is the synchronisation at step ``r * H``. Each replica group's leader
contributes its parameters to it, and the round's *roster* (the groups whose
contribution counts) is decided once, create-if-absent, by the first group that stops
waiting. A group waits only for the groups it *expects*: those whose ``alive`` key
exists and joined before round ``r``. The agent deletes a group's ``alive`` key the
moment its worker exits (agent/strategies/_async.py), so a failed group stops being waited for
within the crash-detection latency: it is dropped from the round, nobody waits for its
restart. A restarted group announces itself (``alive`` with the round it joined at)
only once it holds the current global state, so it is expected from the next round on.

Keys, under ``/stalwart/<job>/async/``::

    m/alive/<g>          {"inc": ..., "round": r}      the group is in, from round r+1
    m/c/<r>/<g>          {"chunks": n}                 its contribution to round r is whole
    m/roster/<r>         [g, ...]                      the round's members (create-if-absent)
    m/global/<r>         {"writer": g, "chunks": n}    the global state after round r
    m/disk/<g>           [step, ...]                   the steps group g holds on disk
    m/join/<g>/<life>    r                             the round that life of g (re)joins at
    m/held/<g>/<life>/<m> [step, ...]                  member m's memory snapshots then
    d/c/<r>/<g>/<i>      contribution bytes, in chunks under the store's value limit
    d/global/<r>/<g>/<i> global state bytes (runtime/replica_groups/_outer.py's format)

Markers and data live under two prefixes so that waiting on the markers never ranges
the data. Rounds older than the last two are deleted by the round's writer, but round
0: group 0's initial parameters, which a group's first life starts from unless a newer
round is published (it then starts from the newest, as a restarted group rejoins).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from stalwart.coordinator.elastic_keys import replica_root
from stalwart.coordinator.store import Compare, Put, wait_for
from stalwart.errors import StalwartError

if TYPE_CHECKING:
    from stalwart.coordinator import Store
    from stalwart.coordinator.store import RangeResult

__all__ = ["CHUNK", "RoundError", "Rounds"]

CHUNK = 1 << 20
"""Bytes per stored value: under the embedded store's and etcd's 1.5 MiB limit."""


class RoundError(StalwartError):
    """A synchronisation round cannot complete (its state is gone from the store)."""


class Rounds:
    """One group's view of the rounds (the store is their owner; this is its client)."""

    def __init__(self, store: Store, job: str, group: int, groups: int, wait_s: float) -> None:
        self.store, self.group, self.groups, self.wait_s = store, group, groups, wait_s
        self._m = f"{replica_root(job)}m/"
        self._d = f"{replica_root(job)}d/"

    # ------------------------------------------------------------ membership
    def announce(self, inc: str, round_: int) -> None:
        """This group holds round ``round_``'s global state: expect it from the next."""
        self._put(f"alive/{self.group}", {"inc": inc, "round": round_})

    def rejoin_round(self, life: str, latest: int | None) -> int | None:
        """The round the members of this group's ``life`` rejoin at: the newest one the
        first of them saw (create-if-absent), so that all of them restore the same one."""
        key = f"{self._m}join/{self.group}/{life}"
        value = json.dumps(-1 if latest is None else latest).encode()
        self.store.txn([Compare(key, "create_revision", "==", 0)], [Put(key, value)])
        kv = self.store.get(key)
        assert kv is not None
        round_ = json.loads(kv.value)
        if type(round_) is not int or round_ < -1:
            raise RoundError(f"{key}: {round_!r} is not a round")
        return None if round_ < 0 else round_

    def start_round(self, life: str, wait_s: float) -> int:
        """The round a first life of this group (not group 0) starts from: round 0 (group
        0's initial parameters) or, when it starts late, after group 0 went on alone, the
        newest published round, as a restarted group rejoins (the rounds between are
        decided without it and may be pruned). Waits at most ``wait_s`` for one to be
        published; the members of ``life`` agree on it as in :meth:`rejoin_round`."""
        prefix = f"{self._m}global/"
        if wait_for(self.store, prefix, lambda s: bool(s.kvs), wait_s) is None:
            raise RoundError(
                f"round 0 (group 0's initial parameters) was not published within "
                f"{wait_s:.0f} s: see replica group 0's log"
            )
        round_ = self.rejoin_round(life, self.latest())
        assert round_ is not None  # the newest round is never pruned
        return round_

    def held_by_all(self, life: str, member: int, size: int, held: list[int]) -> list[int]:
        """The memory snapshot steps that every member of this group's ``life`` holds
        (``held`` this member's, the others' waited for at most ``wait_s``): its DDP
        replicas restore the same one, or their optimizer moments would differ."""
        prefix = f"{self._m}held/{self.group}/{life}/"
        self.store.put(f"{prefix}{member}", json.dumps(sorted(held)).encode())
        snap = wait_for(self.store, prefix, lambda s: len(s.kvs) >= size, self.wait_s)
        if snap is None:
            raise RoundError(f"replica group {self.group}'s members did not all restart")
        common: set[int] = set(held)
        for kv in snap.kvs:
            steps = json.loads(kv.value)
            if not (isinstance(steps, list) and all(type(x) is int for x in steps)):
                raise RoundError(f"{kv.key}: {steps!r} is not a list of steps")
            common &= set(steps)
        return sorted(common)

    def persisted(self, steps: list[int] | None) -> list[int]:
        """The steps that every group holds in its persisted checkpoint: this group's
        ``steps`` published (None: a member that is not the group's leader), every
        group's waited for (at most ``wait_s``). A relaunch resumes from the newest of
        them (runtime/replica_groups/_rejoin.py); all groups compute it alike."""
        if steps is not None:
            self._put(f"disk/{self.group}", sorted(steps))
        prefix = f"{self._m}disk/"
        snap = wait_for(self.store, prefix, lambda s: len(s.kvs) >= self.groups, self.wait_s)
        if snap is None:
            raise RoundError(
                f"not every one of the {self.groups} replica groups said which checkpoints "
                f"it holds within {self.wait_s:.0f} s: see the missing groups' logs"
            )
        common: set[int] | None = None
        for kv in snap.kvs:
            held = json.loads(kv.value)
            if not (isinstance(held, list) and all(type(x) is int and x > 0 for x in held)):
                raise RoundError(f"{kv.key}: {held!r} is not a list of steps > 0")
            common = set(held) if common is None else common & set(held)
        return sorted(common or ())

    # ------------------------------------------------------------ one round
    def contribute(self, round_: int, blob: bytes) -> None:
        n = self._chunks(f"{self._d}c/{round_}/{self.group}/", blob)
        self._put(f"c/{round_}/{self.group}", {"chunks": n})

    def agreed(self, round_: int) -> list[int] | None:
        """The round's roster, if decided."""
        kv = self.store.get(f"{self._m}roster/{round_}")
        return None if kv is None else _groups(json.loads(kv.value), self.groups)

    def agree(self, round_: int) -> list[int]:
        """Wait for every expected group's contribution (at most ``wait_s``), then the
        roster: the one decided first, by whichever group stopped waiting first."""
        snap = wait_for(self.store, self._m, lambda s: self._ready(s, round_), self.wait_s)
        have = self._contributors(snap or self.store.range(self._m), round_)
        key = f"{self._m}roster/{round_}"
        if have:
            self.store.txn(
                [Compare(key, "create_revision", "==", 0)], [Put(key, json.dumps(have).encode())]
            )
        roster = self.agreed(round_)
        if roster is None:
            raise RoundError(f"round {round_} has no roster: no group contributed to it")
        return roster

    def contribution(self, round_: int, group: int) -> bytes:
        return self._read(f"c/{round_}/{group}", f"{self._d}c/{round_}/{group}/")

    # ------------------------------------------------------------ the global state
    def publish(self, round_: int, blob: bytes) -> bool:
        """The global state after ``round_``, unless another member published it."""
        key = f"{self._m}global/{round_}"
        if self.store.get(key) is not None:
            return False
        n = self._chunks(f"{self._d}global/{round_}/{self.group}/", blob)
        record = json.dumps({"writer": self.group, "chunks": n}).encode()
        won = self.store.txn([Compare(key, "create_revision", "==", 0)], [Put(key, record)])
        if not won.succeeded:
            self.store.delete(f"{self._d}global/{round_}/{self.group}/", prefix=True)
        return won.succeeded

    def latest(self) -> int | None:
        """The newest round whose global state is published (None: none yet)."""
        rounds = [int(kv.key.rsplit("/", 1)[1]) for kv in self.store.range(f"{self._m}global/").kvs]
        return max(rounds) if rounds else None

    def global_state(self, round_: int, wait_s: float = 0.0) -> bytes:
        """Round ``round_``'s global state (waiting up to ``wait_s`` for it)."""
        key = f"{self._m}global/{round_}"
        if wait_for(self.store, key, lambda s: bool(s.kvs), wait_s) is None:
            raise RoundError(
                f"round {round_}'s global state was never published (every member of it "
                "failed): the job resumes from the newest published round"
            )
        kv = self.store.get(key)
        assert kv is not None
        writer = int(json.loads(kv.value)["writer"])
        return self._read(f"global/{round_}", f"{self._d}global/{round_}/{writer}/")

    def prune(self, round_: int) -> None:
        """Delete the rounds older than ``round_ - 1`` but round 0 (the writer of
        ``round_`` does)."""
        old = round_ - 2
        if old < 1:  # round 0, group 0's initial parameters, is kept: every group's first
            return  # life that finds no newer round starts from it (_rejoin.py)
        for prefix in (self._d, self._m):
            self.store.delete(f"{prefix}c/{old}/", prefix=True)
        self.store.delete(f"{self._d}global/{old}/", prefix=True)
        self.store.delete(f"{self._m}global/{old}")
        self.store.delete(f"{self._m}roster/{old}")

    # ------------------------------------------------------------ internals
    def _expected(self, snap: RangeResult, round_: int) -> set[int]:
        out = {self.group}
        for kv in snap.kvs:
            rest = kv.key[len(self._m) :]
            if rest.startswith("alive/"):
                rec = json.loads(kv.value)
                if isinstance(rec, dict) and int(rec.get("round", round_)) < round_:
                    out.add(int(rest.split("/")[1]))
        return out

    def _contributors(self, snap: RangeResult, round_: int) -> list[int]:
        prefix = f"{self._m}c/{round_}/"
        have = {int(kv.key[len(prefix) :]) for kv in snap.kvs if kv.key.startswith(prefix)}
        return sorted(g for g in have if 0 <= g < self.groups)

    def _ready(self, snap: RangeResult, round_: int) -> bool:
        if any(kv.key == f"{self._m}roster/{round_}" for kv in snap.kvs):
            return True
        return self._expected(snap, round_) <= set(self._contributors(snap, round_))

    def _put(self, name: str, record: Any) -> None:
        self.store.put(f"{self._m}{name}", json.dumps(record).encode())

    def _chunks(self, prefix: str, blob: bytes) -> int:
        n = max(1, -(-len(blob) // CHUNK))
        for i in range(n):
            self.store.put(f"{prefix}{i:06d}", blob[i * CHUNK : (i + 1) * CHUNK])
        return n

    def _read(self, marker: str, prefix: str) -> bytes:
        kv = self.store.get(f"{self._m}{marker}")
        if kv is None:
            raise RoundError(f"{marker} is gone from the store (pruned: this group fell behind)")
        n = int(json.loads(kv.value)["chunks"])
        parts = self.store.range(prefix).kvs
        if len(parts) != n:
            raise RoundError(f"{marker}: {len(parts)} of {n} chunks in the store")
        return b"".join(bytes(kv.value) for kv in parts)


def _groups(value: object, groups: int) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(g, int) and 0 <= g < groups for g in value)):
        raise RoundError(f"a roster {value!r} names groups outside 0..{groups - 1}")
    return value
