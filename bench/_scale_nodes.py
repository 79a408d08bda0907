"""Emulated nodes for bench/scale.py: the agent's real store-facing code per node, the
worker emulated by its progress reports.

Each :class:`Node` has one store client (one connection pool, as an agent's), joins as
member ``node<k>`` with its own lease and heartbeat thread (coordinator/membership.py),
follows the generation with the agent's :class:`JobGeneration`, and polls the store as
the agent's loop does (agent/agent.py ``_poll_store``, every ``poll_s``): the published
verdict, the generation, and (the leader, or every node under etcd:
agent/cluster/_cluster.py ``lost_nodes``) the membership; plus the ring successor's
membership read of agent/cluster/_peerwatch.py (once a second). Its one emulated worker
follows the generation with the worker's real :class:`GenerationWatch` (from its agent's
relay, agent/cluster/_relay.py: a local socket per node), agrees on the
restore step with the real ``agree`` (runtime/rejoin/_rendezvous.py) and asks the real
snapshot cadence at every step (runtime/steps/_cadence.py), its store calls counted apart.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stalwart.agent.cluster._arrivals import ArrivalRelay
from stalwart.agent.cluster._follow import REREAD_S, PrefixFollower, watch_wait
from stalwart.agent.cluster._generation import JobGeneration
from stalwart.agent.cluster._livenodes import LiveNodes
from stalwart.agent.cluster._members import MemberView
from stalwart.coordinator import Compare, Coordinator, CoordinatorConfig, Put, Store, StoreError
from stalwart.runtime.comm._coord import GenerationWatch
from stalwart.runtime.rejoin._arrivals import RelayedArrivals
from stalwart.runtime.rejoin._rendezvous import agree
from stalwart.runtime.steps._cadence import SnapshotCadence

__all__ = ["Counter", "CountingStore", "Node"]

JOB = "scale"
ROOT = f"/stalwart/{JOB}"


class Counter:
    """Store calls, in all and by kind (the call and its key, node ids and numbers
    blanked: ``watch /members/``, ``txn /agreed/#``)."""

    def __init__(self) -> None:
        self.n = 0
        self.kinds: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, kind: str = "") -> None:
        with self._lock:
            self.n += 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def delivered(self, kind: str, events: int) -> None:
        """``events`` a watch's answer carried (listed as ``events <kind>``, not a request)."""
        with self._lock:
            key = f"events {kind}"
            self.kinds[key] = self.kinds.get(key, 0) + events


def call_kind(name: str, args: tuple[Any, ...]) -> str:
    key = args[0] if args and isinstance(args[0], str) else ""
    if not key and args and isinstance(args[0], list) and args[0]:  # a txn: its first key
        key = str(getattr(args[0][0], "key", ""))
    key = re.sub(r"\d+", "#", key.removeprefix(ROOT))
    return f"{name} {key}".strip()


class CountingStore:
    """A Store that counts every call (a round trip to the coordinator) into a Counter;
    a watch's every ``get`` (one long-poll or stream read) counts too."""

    def __init__(self, inner: Any, counter: Counter) -> None:
        self._inner, self._counter = inner, counter

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in ("close",) or not callable(attr):
            return attr
        counter = self._counter

        def counted(*args: Any, **kwargs: Any) -> Any:
            kind = call_kind(name, args)
            opened_at = args[1] if len(args) > 1 else kwargs.get("start_revision")
            if name != "watch" or opened_at is None:  # a watch from a revision: no ping
                counter.add(kind)
            out = attr(*args, **kwargs)
            if name == "watch":
                return _CountedWatch(out, counter, f"long-poll {kind.split(' ', 1)[-1]}")
            return out

        return counted


class _CountedWatch:
    def __init__(self, inner: Any, counter: Counter, kind: str) -> None:
        self._inner, self._counter, self._kind = inner, counter, kind

    def get(self, timeout: float | None = None) -> Any:
        self._counter.add(self._kind)
        out = self._inner.get(timeout)
        if out:
            self._counter.delivered(self._kind.split(" ", 1)[-1], len(out))
        return out

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _CountedWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Quiet:
    """The agent's event sink and launch record, unused by what is measured."""

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def publish(self, key: str, record: dict[str, Any]) -> None:
        pass

    def read(self, key: str, timeout: float) -> dict[str, Any]:
        return {}


class Node:
    def __init__(
        self, idx: int, inner: Any, ops: Counter, steps: Counter, cfg: dict[str, Any]
    ) -> None:
        self.idx = idx
        self.inner = inner  # the one store client (its connection pool) of this node
        self.store: Store = CountingStore(inner, ops)  # type: ignore[assignment]
        self.step_store: Store = CountingStore(inner, steps)  # type: ignore[assignment]
        self.cfg = cfg
        lease = float(cfg["lease_s"])
        conf = CoordinatorConfig(job_id=JOB, lease_ttl=lease, heartbeat_interval=lease / 4)
        self.coord = Coordinator(self.store, conf)
        self.stop = threading.Event()
        self.agreed: dict[int, float] = {}  # generation -> when this node's worker agreed
        self.woken = threading.Event()  # a peer's death was seen here: poll now
        self.leader = idx == 0
        self.bumped_at = 0.0  # when this node (the adopter) moved the generation
        self.step = 0
        self._known: set[int] = set()
        self._lost: set[int] = set()
        self._last_live: tuple[set[int], set[int]] = (set(), set())
        self._next_ring = self._next_verdict = 0.0
        # agent/cluster/_livenodes.py (--scan members: every node follows every member key,
        # before the digest; None: --scan range, a range per look, before that)
        self.view: LiveNodes | MemberView | None = None
        self.verdict: Any = None  # agent/cluster/_follow.py (None: --verdict-s > 0, a read)
        self._read_live = False  # a watched peer died here: the next look reads the store
        self.thread = threading.Thread(target=self._run, name=f"node{idx}", daemon=True)

    @property
    def _wait_s(self) -> float:  # the agent's watches wait one lease (at least 5 s)
        return watch_wait(float(self.cfg["lease_s"]))

    # ------------------------------------------------------------ joining
    def _join(self) -> None:
        if self.cfg["scan"] == "view":  # opened here: a node's threads start with it
            self.view = LiveNodes(
                self.store,
                ROOT,
                self.idx,
                claims=self.leader or self.cfg["backend"] == "etcd",  # as Cluster._live
                lease=lambda: self.member.lease if hasattr(self, "member") else None,
                wait_s=self._wait_s,
            )
        elif self.cfg["scan"] == "members":
            self.view = MemberView(self.store, f"{ROOT}/members/", wait_s=self._wait_s)
        if not float(self.cfg["verdict_s"]):  # agent/cluster/_cluster.py published_verdict
            key = f"{ROOT}/launch/verdict"
            self.verdict = PrefixFollower(
                lambda: self.store,
                key,
                name=f"verdict{self.idx}",
                wait_s=self._wait_s,
                reread_s=REREAD_S,
            )
        member = self.coord.join(f"node{self.idx}", node=str(self.idx))
        member.start_heartbeat()
        self.member = member
        self.coord = self.coord.as_member(self.coord.fence_of(member))
        self.store.put(f"{ROOT}/joined/node{self.idx}", b"emulated")
        self.store.put(f"{ROOT}/ranks/node{self.idx}", json.dumps([self.idx]).encode())
        if isinstance(self.view, LiveNodes):  # Cluster.start: the writer from the start
            self.view.tick()
        self.gen = JobGeneration(self.coord, _Quiet(), _Quiet(), int(self.cfg["n"]))
        self.gen.sync()
        if self.cfg.get("feed", True):  # agent.py: the generation from a watch
            self._feed_close = self.gen.started(0)
        # the worker: its own coordinator view (fenced by our lease), its generation watch
        self.wcoord = Coordinator(self.store, self.coord.config, fence=self.coord.fence)
        relay = self.gen.relay_address if self.cfg.get("relay", True) else ""
        # the contract's wait; the generation from the agent's relay (a local socket)
        self.genwatch = GenerationWatch(self.wcoord, wait_s=self._wait_s, relay=relay)
        self.cadence = SnapshotCadence(JOB, self, self.step_store)  # type: ignore[arg-type]
        # the workers arrive through the agent (agent/cluster/_arrivals.py): one
        # transaction and one watch per node; each worker its own connection to it
        self.arrivals = ArrivalRelay(self.store, ROOT) if self.cfg.get("arrivals", True) else None
        self._clients: dict[int, RelayedArrivals] = {}

    @property
    def rank(self) -> int:  # the cadence's Position: our rank among the live nodes
        return self._rank

    def _agree(self, min_generation: int, live: list[int]) -> None:
        """Every worker of this node agrees (``--workers-per-node``: each arrives and waits
        for the agreement itself, as a real node's workers do); the node has agreed when
        its last worker has."""
        per = int(self.cfg.get("workers", 1))
        self._rank = live.index(self.idx) * per
        ranks, world = range(self._rank, self._rank + per), len(live) * per
        if per == 1:
            a = self._agree_rank(self._rank, world, min_generation)
        else:
            with ThreadPoolExecutor(per, thread_name_prefix=f"w{self.idx}") as pool:
                every = list(pool.map(lambda r: self._agree_rank(r, world, min_generation), ranks))
            a = every[0]  # one agreement: the same for each of them
        self.agreed[a.generation] = time.monotonic()
        self.genwatch.follow(a.generation)

    def _agree_rank(self, rank: int, world: int, min_generation: int) -> Any:
        info = {"rank": rank, "steps": [self.step - 1, self.step], "done": self.step}
        relay = None
        if self.arrivals is not None:  # the worker's own connection, as in its process
            local = rank % int(self.cfg.get("workers", 1))
            per = int(self.cfg.get("workers", 1))
            relay = self._clients.setdefault(local, RelayedArrivals(self.arrivals.address, per))
        return agree(
            self.store,
            self.wcoord,
            JOB,
            rank,
            world,
            info,  # type: ignore[arg-type]
            use_memory=True,
            disk_step=None,
            min_generation=min_generation,
            timeout_s=float(self.cfg["agree_timeout_s"]),
            relay=relay,
        )

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            self._loop()
        except StoreError:
            if not self.stop.is_set():  # killed: its client closed under it
                raise

    def _loop(self) -> None:
        self._join()
        self._agree(0, list(range(int(self.cfg["n"]))))
        poll_s, step_s = float(self.cfg["poll_s"]), float(self.cfg["step_s"])
        next_poll = next_step = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if self.woken.is_set():  # the wake was ours, not a new generation
                watch = self.genwatch
                watch.follow(watch.current)
                if watch.seen > watch.current:
                    watch.moved.set()
            if self.genwatch.moved.is_set():  # the worker leaves its group, re-agrees
                live = self.cfg["live"]()
                self._agree(self.genwatch.seen, sorted(live))
            if now >= next_poll or self.woken.is_set():
                self.woken.clear()
                self._poll(now)
                next_poll = now + poll_s
            if now >= next_step:
                self.step += 1  # a progress report; the step asks the snapshot cadence
                self.cadence.due(self.step, lambda: 5)
                next_step = now + step_s
            self.genwatch.moved.wait(max(0.0, min(next_poll, next_step) - time.monotonic()))

    def _poll(self, now: float) -> None:
        """agent.py ``_poll_store``: the store part of it."""
        if self.verdict is not None:
            self.verdict.snapshot()  # from its watch: no request
        elif now >= self._next_verdict:  # once a second before (every poll before that)
            self._next_verdict = now + float(self.cfg["verdict_s"])
            self.store.get(f"{ROOT}/launch/verdict")
        if now >= self._next_ring:  # agent/cluster/_peerwatch.py tick: the ring successor
            self._next_ring = now + 1.0
            self._live()
        if isinstance(self.view, LiveNodes):  # Cluster.lost_nodes: the writer's part
            self.view.tick()
        if self.leader or self.cfg["backend"] == "etcd":
            self._lost_nodes()
        self.gen.follow()

    def _live(self) -> set[int]:
        if self.view is None:
            return {int(m[4:]) for m in self.coord.members() if m.startswith("node")}
        return set(self.view.nodes())

    def _lost_nodes(self) -> None:
        """agent/cluster/_cluster.py ``lost_nodes``: claim a node whose lease is gone, then move
        the job to the next generation (the adopter's recovery)."""
        fresh = self._read_live and self.view is not None  # Cluster.lost_nodes after a death
        self._read_live = False
        live = set(self.view.read_nodes()) if fresh and self.view is not None else self._live()
        left = self.view.left() if isinstance(self.view, LiveNodes) else set()
        if (live, left) == self._last_live or not live:  # none: every lease lapsed
            return
        self._last_live = (live, left)
        gone = left - self._lost
        if fresh or not isinstance(self.view, LiveNodes):  # the store's own word, or a
            gone |= self._known - live - self._lost  # view of every member (--scan)
        self._known |= live
        for n in sorted(gone):
            if min(live) != self.idx:  # the adopter (the lowest live node) claims it
                continue
            key = f"{ROOT}/adopted/node{n}"
            claim = Put(key, json.dumps({"by": self.idx}).encode())
            fence = [self.coord.fence.compare()] if self.coord.fence else []
            if self.store.txn([Compare(key, "mod_revision", "==", 0), *fence], [claim]).succeeded:
                self.gen.bump(f"node {n} lost")
                self.bumped_at = time.monotonic()
        self._lost |= gone

    # ------------------------------------------------------------ loss
    def peer_gone(self, node: int) -> None:
        """agent/cluster/_peerwatch.py ``_peer_gone``: our watched predecessor's connection
        ended."""
        if self.store.get(f"{ROOT}/members/node{self.idx}") is None:
            return
        if self.store.get(f"{ROOT}/agents-done/node{node}") is not None:
            return
        kv = self.store.get(f"{ROOT}/members/node{node}")
        if kv is None:
            return
        self.store.revoke(kv.lease)
        self._read_live = True
        self.woken.set()
        self.genwatch.moved.set()  # wakes our loop (the agent's wake pipe); see _run
        record = json.dumps({"by": self.idx, "t": time.time()}).encode()
        self.store.put(f"{ROOT}/watch-closed/node{node}", record)

    def close_feed(self) -> None:
        if hasattr(self, "_feed_close"):
            self._feed_close()
        for client in getattr(self, "_clients", {}).values():
            client.close()
        if getattr(self, "arrivals", None) is not None:
            self.arrivals.close()

    def kill(self) -> None:
        """The process dies: its loop stops, its connections close (its heartbeat
        thread ends on the closed client), nothing says goodbye."""
        self.stop.set()
        self.genwatch.moved.set()
        self.genwatch.close()
        self._close_followers()
        self.close_feed()  # its relay's socket too
        self.inner.close()

    def close(self) -> None:
        self.stop.set()
        self.genwatch.moved.set()
        self.thread.join(10)
        self.genwatch.close()
        self._close_followers()
        self.member.leave()
        self.close_feed()
        self.inner.close()

    def _close_followers(self) -> None:
        for follower in (self.view, self.verdict):
            if follower is not None:
                follower.close()


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float) -> float:
    """When ``cond`` first held (monotonic); RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.005)
    return time.monotonic()
