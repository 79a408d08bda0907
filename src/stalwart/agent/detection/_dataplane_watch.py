"""The agent's side of a watched data plane: stall -> probe the peers -> fence a side.

The decisions are agent/detection/dataplane.py's (pure); here they meet the board, the peers'
watch listeners (agent/cluster/_peerwatch.py) and the store. A probe is a TCP connection to a
peer agent's watch listener that must answer with its 16-byte nonce within
:data:`PROBE_TIMEOUT_S`: the peer's kernel and agent are reachable over the nodes' own
network, the path a cut data plane loses, unlike the store (which may sit elsewhere).
The prober then closes without a hello, which the listener drops as an unauthenticated
connection (docs/wire-protocol.md): a probe never counts as a watched connection.
Probes run on their own thread, so the agent's loop never waits for a silent peer.

A probe begins once every local rank waited past the hang floor, whatever the step time
(agent/detection/dataplane.py): the answers decide. One failed probe decides nothing: a peer is cut
only when it answered no probe for :data:`UNREACHED_S` in a row (a loaded peer may miss
one), and only once the stall outlived the partition grace (and, to fence this node, the
lease). A stall lasts until the job moves; while a peer does not answer it is probed again
once a second (a cut peer's probe takes that long: its connect times out). A stall longer than
:data:`SAY_AFTER_S` is never silent: one line says what the
ranks wait for and until when the agent lets them wait.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from stalwart.agent._types import EventSink, NodeContext, Say
from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.cluster._fencing import NodeLease
from stalwart.agent.detection.dataplane import Cut, Stall, decide, find_stall
from stalwart.agent.detection.hang import Activity, HangConfig
from stalwart.agent.processes._workers import LocalWorkers
from stalwart.logs import get_logger

__all__ = [
    "PROBE_ATTEMPTS",
    "PROBE_TIMEOUT_S",
    "SAY_AFTER_S",
    "UNREACHED_S",
    "DataPlaneWatch",
    "holder_node",
    "probe",
    "revoke_node",
]

PROBE_TIMEOUT_S = 1.0
"""A peer that does not answer a connect within this is cut from us: an idle agent on a
loaded machine answers a SYN from the kernel and sends its nonce in milliseconds."""
UNREACHED_S = 2.0
"""How long a live peer must fail every probe in a row before it counts as cut (two or
three probes): a peer agent starved for a moment on a loaded machine misses one."""
SAY_AFTER_S = 10.0
"""A stall older than this says, once, what the ranks wait for and until when."""
_log = get_logger(__name__)
_REPROBE_S = 5.0  # while a stall lasts and every peer answered, look again this often


class Sampler(Protocol):
    """What of the hang watch (agent/detection/_detectors.py's ``HangWatch``) a stall is judged
    with: the same CPU samples as a hang."""

    def sample(
        self, pids: dict[int, int], now: float, slowed: frozenset[int] = ...
    ) -> dict[int, Activity]: ...


PROBE_ATTEMPTS = 4
"""Connections one probe opens at once; any that answers answers the probe. A lossy link
is not a cut: at 30% loss a lone connection misses about half its 1 s windows (a lost
SYN is sent again only after 1 s), so a peer behind it looked cut within seconds; four
at once all miss about one window in fifteen, and the three windows in a row that a cut
needs (:data:`UNREACHED_S`) about one in 3,000. A cut link answers none of them."""


def _attempt(address: str, timeout: float) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            deadline = time.monotonic() + timeout
            got = b""
            while len(got) < 16:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                sock.settimeout(left)
                piece = sock.recv(16 - len(got))
                if not piece:
                    return False
                got += piece
            return True
    except (OSError, ValueError):
        return False


def probe(address: str, timeout: float = PROBE_TIMEOUT_S, attempts: int = PROBE_ATTEMPTS) -> bool:
    """Whether the watch listener at ``host:port`` answered with its nonce in time, on any
    of ``attempts`` connections opened at once (:data:`PROBE_ATTEMPTS` says why)."""
    if attempts <= 1:
        return _attempt(address, timeout)
    answered = threading.Event()
    done = threading.Semaphore(0)

    def one() -> None:
        try:
            if _attempt(address, timeout):
                answered.set()
        finally:
            done.release()

    for i in range(attempts):
        threading.Thread(target=one, name=f"stalwart-probe-{i}", daemon=True).start()
    for _ in range(attempts):  # every attempt ends within its timeout (connect, then read)
        done.acquire()
        if answered.is_set():
            return True
    return answered.is_set()


class DataPlaneWatch:
    """Watches for a stall of every local rank in a collective and acts on the probe."""

    def __init__(
        self,
        *,
        config: HangConfig,
        node: int,
        store: Any,
        root: str,
        live: Callable[[], set[int]],
        lease: NodeLease,
        lease_s: float,
        workers: LocalWorkers,
        watch: Sampler,
        events: EventSink,
        say: Say,
        probe_peer: Callable[[str], bool] = probe,
        grace_s: float = 0.0,
    ) -> None:
        """``grace_s``: the partition grace (agent/cluster/_grace.py): a cut is decided only once
        the stall outlived it, so a short partition heals into the same generation."""
        self._config, self._node, self._store, self._root = config, node, store, root
        self._live, self._lease, self._workers, self._watch = live, lease, workers, watch
        self._lease_s, self._grace_s = lease_s, grace_s
        self._probed_at = (0.0, 0.0)  # (the stall's age, the time) when the last probe began
        self._unreached: dict[int, float] = {}  # peer -> start of its first missed probe in a row
        self._decide_at = 0.0  # the stall age from which a cut found is decided
        self._answered = False  # every peer answered the latest probe
        self._said = False  # this stall's wait line was said
        self._events, self._say, self._probe = events, say, probe_peer
        self._since = 0.0  # the last stall we acted on or the last recovery: not before
        self._episode: Stall | None = None  # the stall being probed
        self._moved = 0.0  # when the job last moved, as the episode began
        self._next_probe = 0.0
        self._pending: threading.Thread | None = None
        self._reached: tuple[set[int], set[int]] | None = None  # (live, reached)
        self._hang_s = max(config.idle_s, config.ceiling_s)  # agent/detection/hang.py's remote wait

    @classmethod
    def for_node(
        cls, ctx: NodeContext, workers: LocalWorkers, watch: Sampler, cluster: Cluster
    ) -> DataPlaneWatch | None:
        """None on one node (no data plane between nodes) or without a peer watch."""
        if ctx.cfg.nnodes < 2 or cluster.watch is None:
            return None
        return cls(
            config=ctx.cfg.hang,
            node=ctx.cfg.node_rank,
            store=cluster.store,
            root=cluster.watch.root,
            live=cluster.live_nodes,
            lease=cluster.lease,
            lease_s=ctx.cfg.node_lease_s,
            workers=workers,
            watch=watch,
            events=ctx.events,
            say=ctx.say,
            grace_s=ctx.cfg.partition_grace_s,
        )

    def recovery_began(self, now: float) -> None:
        self._since = now
        self._end_episode()

    def _end_episode(self) -> None:
        self._episode, self._said, self._answered = None, False, False
        self._unreached.clear()

    def check(self, now: float, slowed: frozenset[int]) -> Cut | None:
        """One look per loop turn; the :class:`Cut` once this node acted on one.
        Raises :class:`~stalwart.agent.cluster._fencing.NodeFenced` when it fenced itself."""
        slots = self._workers.judged()
        pids = {r: self._workers[r].pid for r in slots}
        activity = self._watch.sample(pids, now, slowed)
        stall = find_stall(slots, now, self._config, activity, since=self._since)
        moved = max(self._since, *(s.t_progress for s in slots.values()), 0.0)
        if self._episode is not None and moved > self._moved:
            self._end_episode()  # the job moved: the data plane carries
        if stall is None:  # (the episode is kept: only the job moving ends it)
            return None
        if self._episode is None:  # (a remote rank's long eval looks the same: quiet)
            self._episode, self._moved = stall, moved
            _log.debug(
                "ranks %s all wait in a collective with no progress for %.1f s (hang floor "
                "%.1f s): probing the other agents",
                stall.ranks,
                stall.stalled_s,
                stall.threshold_s,
            )
        if self._reached is not None:
            live, reached = self._reached
            self._reached = None
            self._answered = reached >= live - {self._node}
            for n in live - reached - {self._node}:
                self._unreached.setdefault(n, self._probed_at[1])
            for n in reached:
                self._unreached.pop(n, None)
            cut = self._act(now, stall, decide(self._node, live, reached, self._holder(live)))
            if cut is not None:
                return cut
        elif self._pending is None and now >= self._next_probe:
            self._probed_at = (stall.stalled_s, now)
            self._pending = threading.Thread(
                target=self._probe_all, name="stalwart-dataplane", daemon=True
            )
            self._pending.start()
            return None
        if stall.stalled_s > SAY_AFTER_S and not self._said and self._pending is None:
            self._said = True  # once per stall, with what the latest probe found
            self._say(self._waiting(stall, now))
        return None

    def _probe_all(self) -> None:
        """The probe thread: which live peers answer (their addresses from the store)."""
        try:
            live = self._live() | {self._node}
            peers: dict[int, str] = {}
            for n in live - {self._node}:
                kv = self._store.get(f"{self._root}/launch/watch-node{n}")
                if kv is not None:
                    peers[n] = kv.value.decode()
            with ThreadPoolExecutor(max_workers=max(1, len(peers))) as pool:
                answers = dict(zip(peers, pool.map(self._probe, peers.values()), strict=True))
            self._reached = (live, {n for n, ok in answers.items() if ok})
        except Exception as err:  # the store away: the lease watch judges that
            self._say(f"data plane probe failed ({err}); the lease watch judges the store")
        finally:
            self._pending = None

    def _holder(self, live: set[int]) -> int:
        return holder_node(self._store, self._root, live)

    def _act(self, now: float, stall: Stall, cut: Cut | None) -> Cut | None:
        """Say what the probe found; fence this node or the nodes it could not reach.
        The fenced nodes' loss is then reported and recovered as any lost node's (its
        ``fault_detected`` says the data plane was cut, dated from the stall)."""
        if cut is None:  # every peer answered: a remote rank computes or is hung (its
            self._next_probe = now + _REPROBE_S  # agent judges that): nothing to say
            return None
        # a peer that is dead (power, SIGSTOP), not cut, answers no probe either, but its
        # lease expires within the TTL and it drops out of the live set: only a peer still
        # live past the lease is cut from us (else we would fence ourselves for a dead
        # rank 0's node instead of adopting its ranks). And a cut shorter than the grace
        # heals into the same generation: decided only once the stall outlived it.
        wait = self._lease_s + PROBE_TIMEOUT_S if cut.fence_self else 0.0
        age, began = self._probed_at
        missed = min(began - self._unreached.get(n, began) for n in cut.unreachable)
        self._decide_at = wait + self._grace_s
        if age <= self._decide_at or missed < UNREACHED_S:
            self._next_probe = began + PROBE_TIMEOUT_S  # a cut peer's probe took that
            return None
        line = f"{cut.how}; detected in {stall.stalled_s:.2f} s"
        self._events.emit("note", message=line)
        self._say(line)
        t0 = time.time() - stall.stalled_s  # when the job last moved: the fault's time
        for n in cut.fence:
            self._revoke(n, cut.how, t0)
        self._since = now
        self._end_episode()
        self._next_probe = now + _REPROBE_S
        if cut.fence_self:  # the agent stops its workers and exits 3 (agent.py's run)
            self._revoke(self._node, cut.how, t0)
            self._lease.lost(cut.how)
            raise self._lease.error()
        return cut

    def _waiting(self, stall: Stall, now: float) -> str:
        """The stall's one line: what the ranks wait for, and until when the agent lets
        them (the hang detector ends ranks that waited for a remote peer that long)."""
        if self._unreached:
            cut = sorted(self._unreached)
            missed = now - min(self._unreached.values())
            what = (
                f"node(s) {cut} answered no data plane probe for {missed:.0f} s; a cut is "
                f"decided once the stall is {max(self._decide_at, self._grace_s):.0f} s old"
            )
        elif self._answered:
            what = (
                "every peer agent answers the data plane probe, so a remote rank computes a "
                "long step or is hung (its own agent judges it)"
            )
        else:
            what = "probing the other agents"
        until = time.strftime("%H:%M:%S", time.gmtime(now - stall.stalled_s + self._hang_s))
        return (
            f"ranks {stall.ranks} have waited {stall.stalled_s:.0f} s in a collective with no "
            f"rank of the job moving; {what}; they are ended as hung at {until} UTC "
            f"({self._hang_s:.0f} s after the job last moved) unless it moves"
        )

    def _revoke(self, node: int, how: str, t0: float) -> None:
        revoke_node(self._store, self._root, node, by=self._node, how=how, t0=t0)


def holder_node(store: Any, root: str, live: set[int]) -> int:
    """The node that holds rank 0 (the tie-break), else the lowest live node."""
    for n in sorted(live):
        with contextlib.suppress(Exception):
            kv = store.get(f"{root}/ranks/node{n}")
            if kv is not None and 0 in json.loads(kv.value):
                return n
    return min(live)


def revoke_node(store: Any, root: str, node: int, *, by: int, how: str, t0: float) -> None:
    """End ``node``'s lease now: what its expiry does, brought forward (the record
    first, so that whoever sees the lease gone finds why: the node-loss detector says
    ``lease revoked: <how>``, dated from ``t0``)."""
    record = json.dumps({"by": by, "t0": t0, "how": how}).encode()
    with contextlib.suppress(Exception):
        store.put(f"{root}/launch/cut-node{node}", record)
    with contextlib.suppress(Exception):
        kv = store.get(f"{root}/members/node{node}")
        if kv is not None and kv.lease:
            store.revoke(kv.lease)
