"""The agent's side of a watched data plane: stall -> probe the peers -> fence a side.

The decisions are agent/dataplane.py's (pure); here they meet the board, the peers'
watch listeners (agent/_peerwatch.py) and the store. A probe is a TCP connection to a
peer agent's watch listener that must answer with its 16-byte nonce within
:data:`PROBE_TIMEOUT_S`: the peer's kernel and agent are reachable over the nodes' own
network, the path a cut data plane loses, unlike the store (which may sit elsewhere).
The prober then closes without a hello, which the listener drops as an unauthenticated
connection (docs/wire-protocol.md): a probe never counts as a watched connection.
Probes run on their own thread, so the agent's loop never waits for a silent peer.
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

from stalwart.agent._cluster import Cluster
from stalwart.agent._fencing import NodeLease
from stalwart.agent._types import EventSink, NodeContext, Say
from stalwart.agent._workers import LocalWorkers
from stalwart.agent.dataplane import Cut, Stall, decide, find_stall
from stalwart.agent.detect import Activity, HangConfig
from stalwart.logs import get_logger

__all__ = ["PROBE_TIMEOUT_S", "DataPlaneWatch", "holder_node", "probe", "revoke_node"]

PROBE_TIMEOUT_S = 1.0
"""A peer that does not answer a connect within this is cut from us: an idle agent on a
loaded machine answers a SYN from the kernel and sends its nonce in milliseconds."""
_log = get_logger(__name__)
_REPROBE_S = 5.0  # while a stall lasts and every peer answered, look again this often


class Sampler(Protocol):
    """What of the hang watch (agent/_detectors.py's ``HangWatch``) a stall is judged
    with: the same CPU samples and step-time history as a hang."""

    history: dict[int, float]

    def sample(
        self, pids: dict[int, int], now: float, slowed: frozenset[int] = ...
    ) -> dict[int, Activity]: ...


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the watch listener at ``host:port`` answered with its nonce in time."""
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
        """``grace_s``: the partition grace (agent/_grace.py): a cut is decided only once
        the stall outlived it, so a short partition heals into the same generation."""
        self._config, self._node, self._store, self._root = config, node, store, root
        self._live, self._lease, self._workers, self._watch = live, lease, workers, watch
        self._lease_s, self._grace_s = lease_s, grace_s
        self._probed_at = 0.0  # the stall's age when the last probe began
        self._events, self._say, self._probe = events, say, probe_peer
        self._since = 0.0  # the last stall we acted on or the last recovery: not before
        self._episode: Stall | None = None  # the stall being probed
        self._next_probe = 0.0
        self._pending: threading.Thread | None = None
        self._reached: tuple[set[int], set[int]] | None = None  # (live, reached)

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
        self._since, self._episode = now, None

    def check(self, now: float, slowed: frozenset[int]) -> Cut | None:
        """One look per loop turn; the :class:`Cut` once this node acted on one.
        Raises :class:`~stalwart.agent._fencing.NodeFenced` when it fenced itself."""
        slots = self._workers.judged()
        pids = {r: self._workers[r].pid for r in slots}
        activity = self._watch.sample(pids, now, slowed)
        stall = find_stall(
            slots, now, self._config, activity, since=self._since, history=self._watch.history
        )
        if stall is None:
            self._episode = None
            return None
        if self._episode is None:  # (a remote rank's long eval looks the same: quiet)
            self._episode = stall
            _log.debug(
                "ranks %s all wait in a collective with no progress for %.1f s (hang bound "
                "%.1f s): probing the other agents",
                stall.ranks,
                stall.stalled_s,
                stall.threshold_s,
            )
        if self._reached is not None:
            live, reached = self._reached
            self._reached = None
            return self._act(now, stall, decide(self._node, live, reached, self._holder(live)))
        if self._pending is None and now >= self._next_probe:
            self._probed_at = stall.stalled_s
            self._pending = threading.Thread(
                target=self._probe_all, name="stalwart-dataplane", daemon=True
            )
            self._pending.start()
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
        if self._probed_at <= wait + self._grace_s:
            self._next_probe = now + PROBE_TIMEOUT_S
            return None
        line = f"{cut.how}; detected in {stall.stalled_s:.2f} s"
        self._events.emit("note", message=line)
        self._say(line)
        t0 = time.time() - stall.stalled_s  # when the job last moved: the fault's time
        for n in cut.fence:
            self._revoke(n, cut.how, t0)
        self._since, self._episode = now, None
        self._next_probe = now + _REPROBE_S
        if cut.fence_self:  # the agent stops its workers and exits 3 (agent.py's run)
            self._revoke(self._node, cut.how, t0)
            self._lease.lost(cut.how)
            raise self._lease.error()
        return cut

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
