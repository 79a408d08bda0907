"""Joining a generation: agree on the step to resume from, then form the group.

Every member publishes, under the generation's key, the steps its shared-memory
snapshots hold and the last step it completed. When all ``world_size`` members are in,
each computes the same answer from the same data: the newest step that *every* member
holds in memory (a member that failed mid-step, or a replacement reading the dead
worker's slots, holds one step less at most), else the newest persisted checkpoint,
else a fresh start. If the generation moves on meanwhile (another failure), everyone
starts over at the new one; nothing from an old generation is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.coordinator import (
    CompactedError,
    Compare,
    Coordinator,
    KeyValue,
    Put,
    Store,
    StoreUnavailableError,
    TxnResult,
    generation_end,
)
from stalwart.coordinator.arrivals import Await, Outcome
from stalwart.errors import CheckpointNotFoundError, FencedError
from stalwart.runtime.rejoin._arrivals import BROKEN, RelayedArrivals

__all__ = [
    "Agreement",
    "agree",
    "choose",
    "finish_barrier",
    "leaving",
    "members_of",
    "no_common_point",
]

_IDLE_S = 0.25  # waiting for arrivals: the generation is read when none came this long
_MEMBER_IDLE_S = 5.0  # waiting for rank 0's record: the bump's end marker says it at once
_READ_S = 0.5  # a member whose watch broke reads the record this often (the fallback)
_RELAY_TXN_S = 30.0  # an arrival through the agent: longer, and the worker writes it itself
_MAX_VALUE = 512 << 10  # an agreement with every member's info, if it fits (etcd: 1.5 MiB)


@dataclass(frozen=True)
class Agreement:
    generation: int
    target: int | None  # step to restore (None: fresh start)
    tier: str  # memory | peer | disk | none (``replica``: decided per rank at the restore)
    last_done: int  # newest step any member had completed (for steps_lost)
    infos: tuple[dict[str, Any], ...] = ()
    """Every member's info where this member holds them: rank 0, and every member at a
    fresh start after generation 0 (no_common_point's message); else :meth:`everyone`."""
    members: tuple[int, ...] = ()  # a digest of the members' pids by rank (members_of)
    leavers: tuple[int, ...] = ()  # the ranks that exit (leaving), decided by rank 0
    fetch: Callable[[], tuple[dict[str, Any], ...]] | None = field(
        default=None, compare=False, repr=False
    )

    def everyone(self) -> tuple[dict[str, Any], ...]:
        """Every member's info: held, else read once from the arrivals (one range, by
        the few members that need them: a rank restoring from a peer's slots)."""
        if not self.infos and self.fetch is not None:
            object.__setattr__(self, "infos", self.fetch())
        return self.infos


def choose(
    infos: list[dict[str, object]], disk_step: int | None, use_memory: bool
) -> tuple[int | None, str]:
    """The restore point from every member's published info (pure; unit-tested).
    Members whose state is their own (not replicated) publish their persisted steps
    (``disk``): the disk tier is then the newest step that every one of them holds."""
    disks = [d for i in infos if isinstance(d := i.get("disk"), list)]
    if infos and len(disks) == len(infos):
        common_disk = set.intersection(*({int(s) for s in d} for d in disks))
        disk_step = max(common_disk) if common_disk else None
    if use_memory and infos:
        held = [{int(s) for s in i.get("steps", [])} for i in infos]  # type: ignore[attr-defined]
        found = _from_memory(held, infos)
        if found is None and any(i.get("replica") for i in infos):
            # slots taken over from a buddy's replica hold no step the others still
            # have: count those members as having lost their memory
            held = [set() if i.get("replica") else h for h, i in zip(held, infos, strict=True)]
            found = _from_memory(held, infos)
        if found is not None:
            return found
    if disk_step is not None:
        return disk_step, "disk"
    return None, "none"


def no_common_point(a: Agreement, done: int, rank: int, *, preloaded: bool = False) -> None:
    """A worker that trained (``done`` > 0), or a standby that preloaded a replica into its
    state, cannot join a fresh start: its tensors hold state that no restore will
    overwrite. It exits instead; its replacement starts from the initial state like every
    other member (the job restarts from step 0, bit-identical, slowly) rather than
    silently mixing trained and initial state."""
    if a.target is None and a.generation > 0 and (done > 0 or preloaded):
        held = f"trained to step {done}" if done > 0 else "preloaded a replica"
        raise CheckpointNotFoundError(
            f"rank {rank}: generation {a.generation} has no step that every member holds "
            f"(memory, replica or disk; held: {_held(a)}) and this worker {held}; it exits so "
            "that the job restarts from the initial state. Keep a common restore point: "
            "--persist-every N, or --replica-rate with --snapshot-every longer than one "
            "replication round"
        )


def leaving(a: Agreement) -> list[int]:
    """The ranks of ``a`` that exit instead of forming its group (:func:`no_common_point`:
    they trained, and ``a`` is a fresh start after generation 0), as every member can
    tell from the agreement. A member that forms the group anyway waits the formation
    timeout (60 s) for ranks that never come; it moves on to the next generation instead,
    where their replacements join."""
    if a.target is not None or a.generation == 0:
        return []
    if not a.infos:
        return sorted(a.leavers)
    return sorted(int(str(i.get("rank", -1))) for i in a.infos if int(str(i.get("done", 0))) > 0)


def members_of(a: Agreement) -> tuple[int, ...]:
    """Who formed ``a``, for telling a recovery that changed nothing (runtime/rejoin/_loops.py
    compares them, nothing else): a digest of the members' pids by rank, the same at
    every member, published by rank 0 so that no member reads N infos for it."""
    if a.members or not a.infos:
        return a.members
    by_rank = sorted(a.infos, key=lambda i: int(i.get("rank", -1)))
    pids = json.dumps([int(i.get("pid", -1)) for i in by_rank]).encode()
    return (int.from_bytes(hashlib.sha256(pids).digest()[:8], "big"),)


def _held(a: Agreement) -> str:
    """What each member said it holds, for the error message."""
    parts = []
    for i in sorted(a.infos, key=lambda i: int(i.get("rank", -1))):
        disk = f" disk {i['disk']}" if "disk" in i else ""
        parts.append(f"rank {i.get('rank')} memory {i.get('steps', [])}{disk}")
    return "; ".join(parts) or "nothing"


def _from_memory(held: list[set[int]], infos: list[dict[str, object]]) -> tuple[int, str] | None:
    holders = [h for h in held if h]
    common = set.intersection(*holders) if holders else set()
    if common and len(holders) == len(held):
        return max(common), "memory"
    # members that lost their memory (a lost node) copy a peer's snapshot, which is
    # the same state when every member holds a replica (DDP), or, under HSDP, when a
    # holder on the same host has the same ``copy`` key (the same shards)
    if common and all(i.get("replicated") for i in infos):
        return max(common), "peer"
    copies = {
        (i["copy"], i.get("host")) for h, i in zip(held, infos, strict=True) if h and "copy" in i
    }
    if common and all(
        h or (i.get("copy"), i.get("host")) in copies for h, i in zip(held, infos, strict=True)
    ):
        return max(common), "peer"
    return None


def agree(
    store: Store,
    coord: Coordinator,
    job: str,
    rank: int,
    world_size: int,
    info: dict[str, object],
    *,
    use_memory: bool,
    disk_step: int | None,
    min_generation: int,
    timeout_s: float,
    fence: Sequence[Compare] = (),
    launch: int = 0,
    relay: RelayedArrivals | None = None,
) -> Agreement:
    """Publish ``info`` at the current generation (>= ``min_generation``) and wait for all
    members; raises TimeoutError at the deadline, and FencedError when a ``fence``
    compare fails (the worker's agent lost its lease: its ranks may run elsewhere).
    ``launch`` (the restart count) keeps apart the workers of a restart and those of the
    launch before it, which may have reached the same generation before being killed.
    ``relay``: the agent's arrival relay (runtime/rejoin/_arrivals.py): the arrival goes
    in the agent's transaction for its node's workers, and the wait on its one watch;
    what it cannot do, the store is asked for directly."""
    deadline = time.monotonic() + timeout_s
    gen = min_generation  # a guess, checked by the arrival's own transaction: no read
    while True:
        prefix = f"/stalwart/{job}/rt/{gen:012d}.{launch}/"
        result = f"/stalwart/{job}/agreed/{gen:012d}.{launch}"
        arrive = Put(prefix + f"{rank:06d}", json.dumps(info).encode())
        # the arrival holds only at ``gen``, under the fence, and (a member) before rank
        # 0's record: then every later word on this agreement is a watch event after it
        guard = [*fence, coord.generation_is(gen)]
        if rank != 0:
            guard.append(Compare(result, "mod_revision", "==", 0))
        arrived = _arrive(store, relay, guard, arrive, deadline)
        if not arrived.succeeded:
            now = coord.generation()
            if now != gen:  # the guess was wrong, or the job moved: try again
                if now < min_generation:
                    coord.advance_generation(now, "a member saw a collective fail")
                    now = max(min_generation, coord.generation())
                gen = now
                continue
            done = store.get(result) if rank != 0 else None
            fenced = bool(fence) and not store.txn(list(fence), []).succeeded
            if done is not None and not fenced:
                # came late (an earlier arrival of this rank was counted): take the record
                return _from_record(dict(json.loads(done.value)), gen, _reader(store, prefix))
            if fenced:
                raise FencedError(
                    f"rank {rank}: this node's agent lost its lease (it was unresponsive "
                    "for longer than --node-lease), so its ranks may have moved to another "
                    f"node; this worker stops instead of joining generation {gen}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(f"generation {gen}: the arrival was refused until the deadline")
            # the generation moved between the refusal and the read (another member of
            # this node advanced it: a relayed node's arrivals are refused together)
            continue
        if rank != 0:  # rank 0 gathers and publishes; the others watch one key
            until = (deadline, timeout_s)
            got = _await(store, coord, result, gen, arrived.revision + 1, until, relay)
            if got is None:
                continue  # the generation moved on: start over at the new one
            return _from_record(got, gen, _reader(store, prefix))
        kvs = _gather(store, coord, prefix, world_size, gen, deadline, timeout_s)
        if kvs is None:
            continue  # the generation moved on: start over at the new one
        own, body = _decide(
            store, job, gen, [json.loads(kv.value) for kv in kvs], disk_step, use_memory
        )
        if not store.txn(list(fence), [Put(result, body)]).succeeded:
            raise FencedError(
                f"rank {rank}: this node's agent lost its lease (it was unresponsive for "
                "longer than --node-lease); this worker stops instead of publishing the "
                f"agreement of generation {gen}"
            )
        return own


def _arrive(
    store: Store, relay: RelayedArrivals | None, guard: list[Compare], put: Put, deadline: float
) -> TxnResult:
    """The arrival's transaction: in the agent's (the relay), else the worker's own."""
    if relay is not None:
        left = min(_RELAY_TXN_S, max(0.1, deadline - time.monotonic()))
        if (done := relay.arrive(guard, put, left)) is not None:
            return done
    return store.txn(guard, [put])


def _await_relayed(
    relay: RelayedArrivals, coord: Coordinator, req: Await, gen: int, until: tuple[float, float]
) -> dict[str, Any] | Outcome | None:
    """:func:`_await` through the agent's one watch for its node's workers, the
    generation read as often (every ``_MEMBER_IDLE_S``); :data:`BROKEN` where the relay
    cannot answer (its watch broke, the agent gone): the caller watches the store."""
    deadline, timeout_s = until
    if not relay.ask_await(req):
        return BROKEN
    next_check = time.monotonic() + _MEMBER_IDLE_S
    while True:
        now = time.monotonic()
        if now >= deadline:
            relay.hang_up()  # its answer, should it come, is not the next call's
            raise TimeoutError(
                f"generation {gen}: rank 0 published no agreement within {timeout_s:.0f}s"
            )
        if now >= next_check:
            if coord.generation() != gen:
                relay.hang_up()
                return None
            next_check = now + _MEMBER_IDLE_S
        got = relay.reply(min(next_check, deadline) - now)
        if got is None:
            continue
        if got.record is not None:
            return dict(json.loads(got.record))
        if got.end:
            return None
        relay.hang_up()
        return BROKEN


def _from_record(
    got: dict[str, Any], gen: int, fetch: Callable[[], tuple[dict[str, Any], ...]]
) -> Agreement:
    """A member's agreement from the record rank 0 published."""
    target = None if got["target"] is None else int(got["target"])
    return Agreement(
        gen,
        target,
        str(got["tier"]),
        int(got["last"]),
        tuple(got.get("infos") or ()),
        tuple(int(m) for m in got.get("members", ())),
        tuple(int(r) for r in got.get("leavers", ())),
        fetch=fetch,
    )


def _decide(
    store: Store,
    job: str,
    gen: int,
    infos: list[dict[str, Any]],
    disk_step: int | None,
    use_memory: bool,
) -> tuple[Agreement, bytes]:
    """Rank 0's agreement from every member's info, and the record it publishes."""
    target, tier = choose(infos, disk_step, use_memory and gen > 0)
    last = max(int(i.get("done", -1)) for i in infos)
    kv = store.get(f"/stalwart/{job}/launch/last-done")
    if kv is not None:  # a restart: the relaunched workers start from nothing
        last = max(last, int(json.loads(kv.value)["step"]))
    own = Agreement(gen, target, tier, last, tuple(infos))
    own = Agreement(gen, target, tier, last, own.infos, members_of(own), tuple(leaving(own)))
    # what every member needs, O(1) in N (the leavers: one node's ranks at most, in
    # practice); every member's info only where every member reads them (a fresh
    # start after generation 0, no_common_point's message), if they fit: N members
    # reading N infos was O(N^2) bytes per failure (docs/scale.md)
    decided: dict[str, Any] = {"target": target, "tier": tier, "last": last}
    decided.update(members=list(own.members), leavers=list(own.leavers))
    body = json.dumps(decided).encode()
    if target is None and gen > 0:
        with_infos = json.dumps({**decided, "infos": infos}).encode()
        body = with_infos if len(with_infos) <= _MAX_VALUE else body
    return own, body


def _reader(store: Store, prefix: str) -> Callable[[], tuple[dict[str, Any], ...]]:
    """Every member's info, read from the arrivals under ``prefix`` when called."""
    return lambda: tuple(json.loads(kv.value) for kv in store.range(prefix).kvs)


def _await(
    store: Store,
    coord: Coordinator,
    key: str,
    gen: int,
    start: int,
    until: tuple[float, float],
    relay: RelayedArrivals | None = None,
) -> dict[str, Any] | None:
    """Rank 0's published agreement at ``key`` (None: the generation moved on), from a
    watch on ``agreed/<gen>.`` from revision ``start``, the one after this member's
    arrival: the record needs every arrival, and the bump past ``gen`` (which writes
    ``agreed/<gen>.end``, coordinator/coordinator.py ``generation_end``) cannot precede an
    arrival its transaction found at ``gen``, so the watch sees either (a read first, to
    look for them, was one request per member and failure more). A member makes O(1)
    requests and receives one event, so an agreement of N members costs O(N) in all
    (every member counting every arrival from a watch was N events each, O(N^2):
    docs/scale.md); the generation is read besides only every ``_MEMBER_IDLE_S`` (each
    member reading it every 0.25 s was ~8 requests a second per member, more than the
    store answers at 1,024 nodes). ``until``: (deadline, the timeout it came from)."""
    deadline, timeout_s = until
    agreed = key.rsplit("/", 1)[0]  # .../agreed
    prefix, end = f"{agreed}/{gen:012d}.", f"{agreed}/{generation_end(gen)}"
    if relay is not None:  # the agent's one watch for its node (runtime/rejoin/_arrivals.py)
        got = _await_relayed(relay, coord, Await(prefix, key, end, start), gen, until)
        if not isinstance(got, Outcome):
            return got
    next_check = time.monotonic() + _MEMBER_IDLE_S
    try:
        with store.watch(prefix, start) as watch:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(
                        f"generation {gen}: rank 0 published no agreement within {timeout_s:.0f}s"
                    )
                if now >= next_check:
                    if coord.generation() != gen:
                        return None
                    next_check = now + _MEMBER_IDLE_S
                for event in watch.get(min(next_check, deadline) - now):
                    if event.type != "put":
                        continue
                    if event.kv.key == key:
                        return dict(json.loads(event.kv.value))
                    if event.kv.key == end:
                        return None
    except (StoreUnavailableError, CompactedError):  # the watch broke; the store may answer
        return _await_by_reads(store, key, end, gen, until)


def _await_by_reads(
    store: Store, key: str, end: str, gen: int, until: tuple[float, float]
) -> dict[str, Any] | None:
    """:func:`_await` after its watch broke (etcd closed every stream open for the node's
    reconnect timeout, at 512 nodes: docs/scale.md, while its reads were answered): the
    record and the end marker read every ``_READ_S`` until the deadline. A store that does
    not answer reads either raises, as before."""
    deadline, timeout_s = until
    while True:
        if (kv := store.get(key)) is not None:
            return dict(json.loads(kv.value))
        if store.get(end) is not None:
            return None
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"generation {gen}: rank 0 published no agreement within {timeout_s:.0f}s"
            )
        time.sleep(min(_READ_S, max(0.0, deadline - time.monotonic())))


def _gather(
    store: Store,
    coord: Coordinator,
    prefix: str,
    world_size: int,
    gen: int,
    deadline: float,
    timeout_s: float,
) -> list[KeyValue] | None:
    """Every member's arrival under ``prefix`` once ``world_size`` are in (None: the
    generation moved on). Counted from a watch's events and read once when complete: a
    member makes O(1) requests however many arrive (a range every 2 ms by every member
    read O(N^2) keys every 2 ms at N members: docs/scale.md), and reads the generation
    every ``_IDLE_S`` (a bump deletes nothing under ``prefix``)."""
    while True:
        snap = store.range(prefix)
        arrived = {kv.key for kv in snap.kvs}
        next_check = time.monotonic() + _IDLE_S
        try:
            with store.watch(prefix, snap.revision + 1) as watch:
                while len(arrived) < world_size:
                    now = time.monotonic()
                    if now >= deadline:
                        raise TimeoutError(
                            f"generation {gen}: {len(arrived)} of {world_size} workers "
                            f"arrived within {timeout_s:.0f}s"
                        )
                    if now >= next_check:
                        if coord.generation() != gen:
                            return None
                        next_check = now + _IDLE_S
                    for event in watch.get(min(next_check, deadline) - now):
                        if event.type == "put":
                            arrived.add(event.kv.key)
                        else:
                            arrived.discard(event.kv.key)
        except (StoreUnavailableError, CompactedError):  # the watch broke: count by reads
            return _gather_by_reads(store, coord, prefix, world_size, gen, (deadline, timeout_s))
        kvs = store.range(prefix).kvs
        if len(kvs) >= world_size:
            return kvs


def _gather_by_reads(
    store: Store,
    coord: Coordinator,
    prefix: str,
    world_size: int,
    gen: int,
    until: tuple[float, float],
) -> list[KeyValue] | None:
    """:func:`_gather` after its watch broke (as :func:`_await_by_reads`): the arrivals
    read every ``_READ_S`` until ``world_size`` are in, the generation moves, or the
    deadline."""
    deadline, timeout_s = until
    while True:
        kvs = store.range(prefix).kvs
        if len(kvs) >= world_size:
            return kvs
        if coord.generation() != gen:
            return None
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"generation {gen}: {len(kvs)} of {world_size} workers arrived within "
                f"{timeout_s:.0f}s"
            )
        time.sleep(min(_READ_S, max(0.0, deadline - time.monotonic())))


def finish_barrier(
    store: Store, coord: Coordinator, prefix: str, who: tuple[int, int, int], timeout_s: float
) -> bool:
    """The end of the job: ``who`` = (rank, world_size, generation) reached the last step;
    True once every member did in this generation, False if the generation moves (a
    member failed on the way) or ``timeout_s`` passes. A member that gives up takes its
    arrival back (best effort): it goes on to recover, and a member arriving later must
    not pass the barrier on its key."""
    rank, world_size, generation = who
    mine = prefix + f"{rank:06d}"
    store.put(mine, b"1")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(store.range(prefix).kvs) >= world_size:
            return True
        if coord.generation() != generation:
            break
        time.sleep(0.005)
    with contextlib.suppress(Exception):  # best effort: it gives up all the same
        store.delete(mine)
    return False
