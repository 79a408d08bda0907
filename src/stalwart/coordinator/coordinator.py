"""``Coordinator``: generations, membership, blocklist and fenced commits over any Store.

A library over a :class:`Store`, not a server: every agent and worker runs its own
against the shared store; all agreement comes from the store's transactions. Every
commit also checks the committer's generation and every bump the caller's lease
(coordinator/fence.py), so a member of an old generation or without a lease (say, the
minority side of a partition) can never commit nor move the job, however late it asks.

Keys live under ``{key_prefix}/{job_id}/``::

    gen                   decimal generation number; absent = generation 0
    gen_meta              JSON: generation, reason, at
    agreed/{gen}.end      the bump past {gen} (its reason): whoever waits for {gen}'s
                          agreement (runtime/rejoin/_rendezvous.py, a watch on
                          agreed/{gen}.) stops waiting at once
    members/{id}          JSON MemberInfo, attached to the member's lease
    failures/{id}         JSON: recent failure times and reasons
    blocklist/{id}        JSON BlockEntry
    rdzv/{gen}/{id}       rendezvous arrivals (member lease)
    barrier/{gen}/{name}/{id}
    step                  JSON StepRecord of the last committed step
    ckpt/{step}, ckpt_latest   JSON CheckpointRecord"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.coordinator.errors import (
    AlreadyCommittedError,
    BlocklistedError,
    MemberExistsError,
    RendezvousTimeoutError,
)
from stalwart.coordinator.fence import Fence
from stalwart.coordinator.membership import Member, MemberInfo, MembershipWatch
from stalwart.coordinator.store import Compare, Delete, Op, Put, Store
from stalwart.errors import ConfigError, FencedError

__all__ = [
    "BlockEntry",
    "CheckpointRecord",
    "Coordinator",
    "CoordinatorConfig",
    "GenerationChange",
    "StepRecord",
    "generation_end",
]


def generation_end(generation: int) -> str:
    """The key, under ``agreed/``, that the bump past ``generation`` writes: the members
    waiting for that generation's agreement watch ``agreed/<generation>.`` and learn
    from this one event that it will never come. A read of the generation every few
    hundred milliseconds by each waiting member was ~8 requests a second per member: at
    1,024 nodes, more than the store answers (docs/scale.md)."""
    return f"{generation:012d}.end"


@dataclass(frozen=True)
class CoordinatorConfig:
    """Timing and policy of a :class:`Coordinator`."""

    job_id: str = "default"
    lease_ttl: float = 10.0  # a member silent this long is considered failed
    heartbeat_interval: float = 2.0  # must leave room for a few misses within the TTL
    failure_threshold: int = 3  # failures within failure_window that blocklist a member
    failure_window: float = 600.0
    key_prefix: str = "/stalwart"

    def __post_init__(self) -> None:
        if not self.job_id or "/" in self.job_id:
            raise ConfigError(f"job id must be non-empty and without '/', got {self.job_id!r}")
        if not self.lease_ttl > 0:
            raise ConfigError(f"lease_ttl must be > 0 seconds, got {self.lease_ttl}")
        if not 0 < self.heartbeat_interval < self.lease_ttl:
            raise ConfigError(
                f"heartbeat_interval ({self.heartbeat_interval}s) must be > 0 and below "
                f"lease_ttl ({self.lease_ttl}s); a third of it is a good choice"
            )
        if self.failure_threshold < 1 or not self.failure_window > 0:
            raise ConfigError("failure_threshold must be >= 1 and failure_window > 0")


@dataclass(frozen=True)
class GenerationChange:
    """Result of :meth:`Coordinator.advance_generation`: did we bump it, and the current one."""

    won: bool
    generation: int


@dataclass(frozen=True)
class BlockEntry:
    member_id: str
    reason: str
    at: float  # wall-clock seconds
    failures: int


@dataclass(frozen=True)
class StepRecord:
    step: int
    generation: int
    by: str
    at: float


@dataclass(frozen=True)
class CheckpointRecord:
    step: int
    generation: int
    by: str
    at: float
    meta: dict[str, Any] = field(default_factory=dict)


def _dump(obj: Any) -> bytes:
    return json.dumps(asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj).encode()


def _check_id(member_id: str) -> None:
    if not member_id or "/" in member_id:
        raise ConfigError(f"member id must be non-empty and without '/', got {member_id!r}")


class Coordinator:
    """Membership, generations, blocklist, rendezvous and fenced commits for one job."""

    def __init__(
        self,
        store: Store,
        config: CoordinatorConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        fence: Fence | None = None,
    ) -> None:
        self.store = store
        self.config = config or CoordinatorConfig()
        self._clock = clock
        self.fence = fence  # checked in every bump; None: no member (a test, a tool)
        self._root = f"{self.config.key_prefix.rstrip('/')}/{self.config.job_id}/"

    def _k(self, *parts: str) -> str:
        return self._root + "/".join(parts)

    def as_member(self, fence: Fence) -> Coordinator:
        """This coordinator acting for the member ``fence`` vouches for (its bumps fenced)."""
        return Coordinator(self.store, self.config, clock=self._clock, fence=fence)

    def fence_of(self, member: Member) -> Fence:
        """The proof of ``member``'s lease: its key's revision at join."""
        key = self._k("members", member.member_id)
        kv = self.store.get(key)
        if kv is None or kv.lease != member.lease:
            raise FencedError(f"member {member.member_id}: its lease is gone; join again")
        return Fence(key, kv.create_revision, member.member_id)

    # -- generations ----------------------------------------------------

    @property
    def generation_key(self) -> str:
        return self._k("gen")  # for a watch on it

    def generation(self) -> int:
        """The job's current generation (0 before the first bump)."""
        kv = self.store.get(self._k("gen"))
        return 0 if kv is None else int(kv.value)

    def generation_is(self, generation: int) -> Compare:
        """A compare that holds while the job is at ``generation``: a write guarded by it
        in one transaction needs no read of the generation first."""
        if generation == 0:
            return Compare(self._k("gen"), "mod_revision", "==", 0)
        return Compare(self._k("gen"), "value", "==", str(generation).encode())

    def _fenced(self, generation: int, what: str) -> FencedError:
        return FencedError(
            f"cannot {what}: generation {generation} is stale (the job is at generation "
            f"{self.generation()}); rejoin the current generation first"
        )

    def advance_generation(
        self, expected: int, reason: str, *, also: Sequence[Op] = ()
    ) -> GenerationChange:
        """Bump the generation from ``expected`` to ``expected + 1`` in one transaction
        that compares the number and the caller's lease (:attr:`fence`) together: of
        members racing to bump, one wins, the others get ``won=False`` and the winner's
        generation; a caller whose lease is gone moves nothing (:class:`FencedError`).
        The old generation's rendezvous and barrier keys are cleared with it, its end
        is marked (:func:`generation_end`), and the ops ``also`` applied (elastic: who
        is admitted), only if the bump wins."""
        new = expected + 1
        meta = {"generation": new, "reason": reason, "at": self._clock()}
        ops: list[Op] = [
            Put(self._k("gen"), str(new).encode()),
            Put(self._k("gen_meta"), _dump(meta)),
            Put(self._k("agreed", generation_end(expected)), reason.encode()),
            Delete(self._k("rdzv", f"{expected:012d}") + "/", prefix=True),
            Delete(self._k("barrier", f"{expected:012d}") + "/", prefix=True),
            *also,
        ]
        fence = self.fence
        guard = [self.generation_is(expected), *([fence.compare()] if fence else [])]
        if self.store.txn(guard, ops).succeeded:
            return GenerationChange(True, new)
        if fence is not None and not fence.holds(self.store):
            raise fence.refused(f"move the job past generation {expected} ({reason})")
        return GenerationChange(False, self.generation())

    def generation_meta(self) -> dict[str, Any]:
        """Why and when the current generation was set (empty at generation 0)."""
        kv = self.store.get(self._k("gen_meta"))
        return {} if kv is None else dict(json.loads(kv.value))

    # -- membership -----------------------------------------------------

    def join(self, member_id: str, *, node: str = "", info: dict[str, Any] | None = None) -> Member:
        """Register ``member_id`` with a fresh lease; refuse blocklisted or duplicate ids."""
        _check_id(member_id)
        cfg = self.config
        lease = self.store.grant(cfg.lease_ttl)
        record = MemberInfo(member_id, node, self._clock(), dict(info or {}))
        res = self.store.txn(
            [
                Compare(self._k("blocklist", member_id), "mod_revision", "==", 0),
                Compare(self._k("members", member_id), "mod_revision", "==", 0),
            ],
            [Put(self._k("members", member_id), record.to_bytes(), lease)],
        )
        if not res.succeeded:
            self.store.revoke(lease)
            entry = self.blocklisted().get(member_id)
            if entry is not None:
                raise BlocklistedError(
                    f"member {member_id} is blocklisted since {entry.at:.0f} ({entry.reason}); "
                    "fix the cause, then unblock it"
                )
            raise MemberExistsError(
                f"member {member_id} is already joined with a live lease; pick another id "
                "or wait for the old one to expire"
            )
        return Member(self.store, member_id, lease, cfg.lease_ttl, cfg.heartbeat_interval)

    def members(self) -> dict[str, MemberInfo]:
        """Live members by id."""
        prefix = self._k("members") + "/"
        return {
            kv.key[len(prefix) :]: MemberInfo.from_bytes(kv.value)
            for kv in self.store.range(prefix).kvs
        }

    def watch_members(self, start_revision: int | None = None) -> MembershipWatch:
        """Join/leave events (a lease expiry shows up as ``left``)."""
        prefix = self._k("members") + "/"
        return MembershipWatch(self.store.watch(prefix, start_revision), prefix)

    # -- failures and blocklist -----------------------------------------

    def record_failure(self, member_id: str, reason: str) -> bool:
        """Count a failure of ``member_id``; blocklist it at ``failure_threshold`` within
        ``failure_window``. Returns whether it is blocklisted now."""
        _check_id(member_id)
        key = self._k("failures", member_id)
        while True:
            kv = self.store.get(key)
            now = self._clock()
            recent = [] if kv is None else json.loads(kv.value)["events"]
            recent = [e for e in recent if now - e["at"] < self.config.failure_window]
            recent.append({"at": now, "reason": reason})
            ops: list[Op] = [Put(key, _dump({"events": recent}))]
            blocked = len(recent) >= self.config.failure_threshold
            if blocked:
                summary = f"{len(recent)} failures within {self.config.failure_window:.0f}s"
                entry = BlockEntry(member_id, f"{summary}, last: {reason}", now, len(recent))
                ops.append(Put(self._k("blocklist", member_id), _dump(entry)))
            rev = 0 if kv is None else kv.mod_revision
            if self.store.txn([Compare(key, "mod_revision", "==", rev)], ops).succeeded:
                return blocked

    def block(self, member_id: str, reason: str) -> None:
        """Blocklist ``member_id`` now (e.g. a failed health probe)."""
        _check_id(member_id)
        entry = BlockEntry(member_id, reason, self._clock(), 0)
        self.store.put(self._k("blocklist", member_id), _dump(entry))

    def unblock(self, member_id: str) -> None:
        """Readmit ``member_id`` and forget its failures."""
        ops: list[Op] = [Delete(self._k(what, member_id)) for what in ("blocklist", "failures")]
        self.store.txn([], ops)

    def blocklisted(self) -> dict[str, BlockEntry]:
        prefix = self._k("blocklist") + "/"
        return {
            kv.key[len(prefix) :]: BlockEntry(**json.loads(kv.value))
            for kv in self.store.range(prefix).kvs
        }

    # -- rendezvous and barriers ----------------------------------------

    def rendezvous(
        self, member: Member, generation: int, min_members: int, timeout: float
    ) -> list[str]:
        """Arrive at generation ``generation``'s rendezvous and wait for ``min_members``.

        Returns the arrived member ids, sorted (a member's rank is its index).
        Raises :class:`FencedError` if the generation moves on meanwhile and
        :class:`RendezvousTimeoutError` at the deadline.
        """
        prefix = self._k("rdzv", f"{generation:012d}") + "/"
        return self._gather(prefix, member, generation, min_members, timeout, "rendezvous")

    def barrier(
        self, member: Member, generation: int, name: str, count: int, timeout: float
    ) -> list[str]:
        """Wait until ``count`` members of ``generation`` reached barrier ``name``."""
        _check_id(name)
        prefix = self._k("barrier", f"{generation:012d}", name) + "/"
        return self._gather(prefix, member, generation, count, timeout, f"barrier {name!r}")

    def _gather(
        self, prefix: str, member: Member, generation: int, count: int, timeout: float, what: str
    ) -> list[str]:
        arrive = Put(prefix + member.member_id, b"", member.lease)
        if not self.store.txn([self.generation_is(generation)], [arrive]).succeeded:
            raise self._fenced(generation, f"join the {what}")
        deadline = time.monotonic() + timeout
        with self.store.watch(self._root, self.store.range(prefix).revision + 1) as watch:
            while True:
                arrived = [kv.key[len(prefix) :] for kv in self.store.range(prefix).kvs]
                if self.generation() != generation:
                    raise self._fenced(generation, f"finish the {what}")
                if len(arrived) >= count:
                    return sorted(arrived)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousTimeoutError(
                        f"{what} of generation {generation}: {len(arrived)} of {count} members "
                        f"arrived within {timeout:.1f}s ({', '.join(sorted(arrived))}); "
                        "check the missing members' logs or lower the member count"
                    )
                watch.get(remaining)

    # -- fenced commits -------------------------------------------------

    def last_step(self) -> StepRecord | None:
        kv = self.store.get(self._k("step"))
        return None if kv is None else StepRecord(**json.loads(kv.value))

    def commit_step(self, generation: int, step: int, by: str = "") -> StepRecord:
        """Record ``step`` as completed in ``generation``; FencedError if it is stale.

        Within a generation steps only move forward (a repeat is
        :class:`AlreadyCommittedError`); a newer generation may restart from an
        earlier step after a rollback.
        """
        key = self._k("step")
        while True:
            kv = self.store.get(key)
            last = None if kv is None else StepRecord(**json.loads(kv.value))
            if last is not None and last.generation == generation and step <= last.step:
                raise AlreadyCommittedError(
                    f"step {step} is not after step {last.step}, already committed in "
                    f"generation {generation}"
                )
            record = StepRecord(step, generation, by, self._clock())
            rev = 0 if kv is None else kv.mod_revision
            cmp = [self.generation_is(generation), Compare(key, "mod_revision", "==", rev)]
            if self.store.txn(cmp, [Put(key, _dump(record))]).succeeded:
                return record
            if self.generation() != generation:
                raise self._fenced(generation, f"commit step {step}")

    def commit_checkpoint(
        self, generation: int, step: int, meta: dict[str, Any] | None = None, by: str = ""
    ) -> CheckpointRecord:
        """Make the checkpoint of ``step`` visible (``ckpt/{step}`` and ``ckpt_latest``)
        exactly once; FencedError if ``generation`` is stale."""
        record = CheckpointRecord(step, generation, by, self._clock(), dict(meta or {}))
        key = self._k("ckpt", f"{step:012d}")
        res = self.store.txn(
            [self.generation_is(generation), Compare(key, "mod_revision", "==", 0)],
            [Put(key, _dump(record)), Put(self._k("ckpt_latest"), _dump(record))],
        )
        if res.succeeded:
            return record
        if self.generation() != generation:
            raise self._fenced(generation, f"commit the checkpoint of step {step}")
        raise AlreadyCommittedError(f"the checkpoint of step {step} is already committed")

    def record_shard_commit(self, generation: int, step: int, shard: str) -> CheckpointRecord:
        """The fenced record that lets ``shard`` (one checkpoint directory) publish its
        manifest of ``step``: a compare-and-swap on the generation, FencedError when it
        is stale. One key per shard, overwritten by its next commit (the store does not
        grow with the run); see docs/checkpoint-format.md, "The fence"."""
        _check_id(shard)
        record = CheckpointRecord(step, generation, shard, self._clock())
        key = self._k("ckpt_shard", shard)
        if self.store.txn([self.generation_is(generation)], [Put(key, _dump(record))]).succeeded:
            return record
        raise self._fenced(generation, f"commit the checkpoint of step {step}")

    def shard_commits(self) -> dict[str, CheckpointRecord]:
        """The newest fenced commit of every shard, by shard name."""
        prefix = self._k("ckpt_shard") + "/"
        return {
            kv.key[len(prefix) :]: CheckpointRecord(**json.loads(kv.value))
            for kv in self.store.range(prefix).kvs
        }

    def latest_checkpoint(self) -> CheckpointRecord | None:
        kv = self.store.get(self._k("ckpt_latest"))
        return None if kv is None else CheckpointRecord(**json.loads(kv.value))
