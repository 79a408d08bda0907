"""How a worker reaches the coordinator (the embedded store or etcd), its fence and
its watch on the generation.

Under ``--rdzv etcd://...`` a worker talks to etcd itself (nothing on node 0) and forms
its gloo groups over etcd too (:class:`CoordStoreC10d`). Under every backend it joins a
generation, and moves one, only while its agent's lease is alive (the *fence*: a
compare on the agent's member key in the same transaction, coordinator/fence.py), so
the workers of a partitioned node can never rejoin under ranks adopted elsewhere nor
move the job; and it watches the generation: when a leader bumps it (a lost node's
ranks were adopted), live workers leave their old group at the next step boundary
instead of training on with the members of a generation the job has left (a node cut
from the coordinator only still reaches its peers: nothing else would stop them).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stalwart.contract.env import WorkerEnv
from stalwart.contract.shm_names import SlotNames
from stalwart.coordinator import (
    Compare,
    Coordinator,
    CoordinatorConfig,
    Delete,
    Fence,
    GenerationChange,
    Op,
    Put,
    Store,
    StoreClient,
)
from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from stalwart.coordinator import Watch
    from stalwart.runtime.comm._c10d_store import CoordStoreC10d

__all__ = [
    "CommitKeys",
    "GenerationWatch",
    "c10d_store",
    "fence_compares",
    "open_store",
    "relay_connect",
    "worker_coordinator",
    "worker_fence",
]


def open_store(env: WorkerEnv) -> Store:
    if env.rdzv:
        from stalwart.coordinator import EtcdStore, EtcdStoreConfig

        return EtcdStore.from_url(env.rdzv, EtcdStoreConfig(reconnect_timeout=60.0))
    assert env.store is not None
    return StoreClient.from_token_file(env.store[0], env.store[1], env.token_file)


def c10d_store(env: WorkerEnv, store: Store | None) -> CoordStoreC10d | None:
    """The torch Store gloo forms groups over (None: the TCPStore at ``env.c10d``)."""
    if not env.rdzv or store is None:
        return None
    from stalwart.runtime.comm._c10d_store import CoordStoreC10d

    return CoordStoreC10d(store, f"/stalwart/{env.job}/c10d/", timedelta(seconds=300))


def _agent_fence(env: WorkerEnv) -> str:
    """``node:revision`` of the agent's lease: the contract's, or the newer one the agent
    wrote to /dev/shm after it rejoined within the partition grace (agent/cluster/_grace.py)."""
    node = env.fence.partition(":")[0]
    if env.shm_run and node.isdigit():
        with contextlib.suppress(OSError, ConfigError, UnicodeDecodeError):
            with open(SlotNames(env.job, env.shm_run).fence_file(int(node)), "rb") as f:
                text = f.read(64).decode().strip()
            if text.partition(":")[0] == node:
                return text
    return env.fence


def worker_fence(env: WorkerEnv) -> Fence | None:
    """The lease that vouches for this worker: its agent's (None: no agent gave one)."""
    node, sep, rev = _agent_fence(env).partition(":")
    if not sep or not rev.isdigit() or int(rev) <= 0:
        return None
    key = f"/stalwart/{env.job}/members/node{node}"
    return Fence(key, int(rev), f"rank {env.rank} of node {node}")


class _WorkerCoordinator(Coordinator):
    """A worker's coordinator: its fence read again before every bump (the agent's lease
    may be a new one since the worker started: a rejoin within the partition grace)."""

    def __init__(self, store: Store, env: WorkerEnv) -> None:
        super().__init__(store, CoordinatorConfig(job_id=env.job), fence=worker_fence(env))
        self._env = env

    def advance_generation(
        self, expected: int, reason: str, *, also: Sequence[Op] = ()
    ) -> GenerationChange:
        self.fence = worker_fence(self._env)
        return super().advance_generation(expected, reason, also=also)


def worker_coordinator(env: WorkerEnv, store: Store) -> Coordinator:
    """The worker's coordinator: every generation bump through it checks the fence."""
    return _WorkerCoordinator(store, env)


def fence_compares(env: WorkerEnv) -> list[Compare]:
    """Compares that hold while this worker's agent still holds its lease."""
    fence = worker_fence(env)
    return [] if fence is None else [fence.compare()]


class CommitKeys:
    """The job's store as the sharded commit uses it (``checkpoint.CommitStore``: the
    claim of who commits a sharded step, checkpoint/commit.py): four key operations on
    the coordinator's :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def put(self, key: str, value: bytes) -> None:
        self.store.put(key, value)

    def keys(self, prefix: str) -> list[str]:
        return [kv.key for kv in self.store.range(prefix).kvs]

    def create(self, key: str, value: bytes) -> bool:
        absent = Compare(key, "mod_revision", "==", 0)
        return self.store.txn([absent], [Put(key, value)]).succeeded

    def delete_prefixes(self, prefixes: Collection[str]) -> None:
        self.store.txn([], [Delete(p, prefix=True) for p in prefixes])


_RELAY_LINE = 20  # digits of a generation on the relay (a 64-bit number)


def relay_connect(address: str) -> socket.socket | None:
    """The agent's relay (``@name``: the abstract namespace; the generation's or the
    arrivals'), if it is there and owned by this user (a name another user bound first
    is not our agent's); None otherwise. The socket blocks, without a timeout."""
    if not address.startswith("@") or len(address) > 100:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)  # (a full listen queue: the store instead, not a hang)
        sock.connect("\0" + address[1:])
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise OSError(f"the relay {address} belongs to uid {uid}")
        sock.settimeout(None)
        return sock
    except OSError:
        sock.close()
        return None


class GenerationWatch:
    """Follows the job's generation; :attr:`moved` is set once it passes ``current``.

    A store watch on the generation key says so at once (a worker stuck in a collective
    with a lost peer leaves it then, runtime/comm/group.py); a read every ``read_s``
    is a belt-and-braces look besides it; a watch that broke (etcd restarted, its history
    compacted) raises, and the generation is read every ``interval_s`` until a new one is
    open. On the embedded store a watch is a long-poll of up to ``wait_s`` (the agent's:
    one node lease, at least 5 s): one request per ``wait_s`` per worker in steady state
    (it was a 0.5 s long-poll and a read a second: 3 requests a second per worker, the
    largest steady load at N nodes, docs/scale.md); ``read_s`` at least as long.

    ``relay`` (the contract's ``gen_relay``): the agent's socket that tells its workers
    each generation its own watch delivers (agent/cluster/_relay.py). The worker connects,
    reads the generation once, and follows the relay's lines: no store request while the
    relay lasts. When it ends (its agent closing) or cannot be reached, the worker
    watches the store as above."""

    def __init__(
        self,
        coord: Coordinator,
        interval_s: float = 1.0,
        read_s: float = 30.0,
        *,
        wait_s: float = 5.0,
        relay: str = "",
    ) -> None:
        self.coord = coord
        self.relay = relay
        self._relay_sock: socket.socket | None = None
        self.wait_s = wait_s  # one long-poll (the contract's watch_wait_s)
        self.current = 0
        self.seen = 0  # the newest generation this watch saw (only ever increased)
        self.interval_s, self.read_s = interval_s, max(read_s, interval_s, wait_s)
        self.moved = threading.Event()
        self._lock = threading.Lock()  # a set() never lands after follow() moved past it
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._run, name="stalwart-genwatch", daemon=True)
        self._thread.start()

    def follow(self, generation: int) -> None:
        with self._lock:
            self.current = generation
            self.moved.clear()

    def left(self, generation: int) -> bool:
        """The job moved past ``generation`` (a group of it waits in vain: leave it).
        Relative to the group's own generation, not to :attr:`current`: a group being
        formed for a newer generation is not left for the bump that made it."""
        return self.seen > generation

    def _saw(self, generation: int) -> bool:
        with self._lock:
            self.seen = max(self.seen, generation)
            if generation > self.current:
                self.moved.set()
        return self.moved.is_set()

    def _check(self) -> None:
        self._saw(self.coord.generation())

    def _seen(self, events: list[Any]) -> None:
        """A watch event carries the new generation: no read needed (one store round
        trip less between a node's loss and its survivors leaving their collective)."""
        for event in events:
            try:
                generation = int(event.kv.value)
            except (AttributeError, TypeError, ValueError):  # a delete, or unexpected
                self._check()
                return
            if self._saw(generation):
                return

    def _run(self) -> None:
        if self.relay:
            self._follow_relay()  # returns when the relay ends: then the store's watch
        watch: Watch | None = None
        next_read = 0.0
        while not self._stop.is_set():
            try:
                if watch is None:  # open first, then read: no bump falls in between
                    watch = self._watch = self.coord.store.watch(self.coord.generation_key)
                    next_read = 0.0
                if time.monotonic() >= next_read:
                    self._check()
                    next_read = time.monotonic() + self.read_s * random.uniform(0.75, 1.0)
                # up to a quarter less at random: the workers of a job start together and
                # would renew their long-polls together for as long as it runs
                wait = min(self.wait_s, self.read_s) * random.uniform(0.75, 1.0)
                events = watch.get(timeout=wait)
                if events:
                    self._seen(events)
            except Exception:  # etcd away for a moment: poll until a watch opens again
                if watch is not None:
                    with contextlib.suppress(Exception):
                        watch.close()
                watch = None
                with contextlib.suppress(Exception):
                    self._check()
                self._stop.wait(self.interval_s)
        if watch is not None:
            with contextlib.suppress(Exception):
                watch.close()

    def _follow_relay(self) -> None:
        sock = relay_connect(self.relay)
        if sock is None:
            return
        self._relay_sock = sock
        try:
            if self._stop.is_set():
                return
            self._check()  # after the connect: every later bump comes as a line
            pending = b""
            while not self._stop.is_set():
                data = sock.recv(4096)
                if not data:  # the agent closed it
                    return
                *lines, pending = (pending + data).split(b"\n")
                if len(pending) > _RELAY_LINE:
                    return
                for line in lines:
                    if not (line.isdigit() and len(line) <= _RELAY_LINE):
                        return  # not the relay's format: the store instead
                    self._saw(int(line))
        except Exception:  # the store away at the first read, or the socket failed
            return
        finally:
            self._relay_sock = None
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self._stop.set()
        if (sock := self._relay_sock) is not None:  # ends its recv
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._watch is not None:  # ends a get() in progress on an in-process store
            with contextlib.suppress(Exception):
                self._watch.close()
        # a long-poll over the network ends when its client closes (the session's next
        # step): not waited for here, as agent/cluster/_genfeed.py
        self._thread.join(0.5)
