"""Peer memory replicas: each agent keeps its node's newest snapshots in a buddy's memory.

Every agent runs a :class:`~stalwart.transfer.SlotReceiver` (its address is published at
``replica/node<k>`` in the store) and a :class:`~stalwart.transfer.Replicator` that
streams the newest complete slot of each of its ranks to its *buddy*: the next live node
in the ring of node ids (node 0 -> 1 -> ... -> 0), chunked, checksummed, authenticated
with the job token, in the background, under one bandwidth cap per node. Copies land at
the buddy as namespace ``SlotNames.replica(rank)`` (contract/shm_names.py).

When a whole node is lost (agent, workers and its /dev/shm gone), its buddy is the node
that adopts its ranks (agent/cluster/_cluster.py): its memory already holds their snapshots, so
taking over is a rename on tmpfs (the received slot directory becomes the rank's own,
``<job>-r<rank>``, after the receiver released it), and the adopted workers restore from
it as from their own memory: no disk, no network. When the buddy has no complete copy of
every lost rank (replication off, or the node died before its first copy completed), the
adopted ranks start with empty slots and the usual rules apply (a same-host peer's copy
of replicated DDP state, else the newest persisted checkpoint).

Why the buddy adopts rather than a fixed leader: the replica is where the memory is;
any other adopter would first have to pull it over the network.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable

from stalwart.agent._types import NodeContext
from stalwart.agent.cluster._cluster import Cluster, ring_successor
from stalwart.checkpoint.slots import latest_complete, slot_count, write_replica_marker
from stalwart.transfer import (
    ReceiverConfig,
    ReplicaConfig,
    Replicator,
    SlotReceiver,
    TransferError,
)

__all__ = ["NodeReplicas"]


class NodeReplicas:
    def __init__(
        self,
        cluster: Cluster,
        ranks: Callable[[], list[int]],
        note: Callable[[str], None],
        *,
        host: str,
        rate_bytes_per_s: float,
    ) -> None:
        """``ranks``: the ranks this node runs now (adopted ones too); ``note``: says
        and records a line (replication fell behind, a takeover was abandoned)."""
        self._cluster, self._ranks, self._note = cluster, ranks, note
        self.job = cluster.cfg.job
        self.names = cluster.names
        self._node = cluster.node
        self._key = f"/stalwart/{self.job}/replica/node"
        self.rx = SlotReceiver(
            cluster.token, ReceiverConfig(shm_dir=self.names.shm_dir, host=host, slots=2)
        )
        rx_host, rx_port = self.rx.start()
        doc = {"host": rx_host, "port": rx_port, "hostname": socket.gethostname()}
        cluster.store.put(f"{self._key}{self._node}", json.dumps(doc).encode())
        self._buddy: tuple[int, tuple[str, int]] | None = None
        self._looked = 0.0
        self.rep = Replicator(
            cluster.token,
            self._buddy_address,
            self._sources(),
            ReplicaConfig(rate_bytes_per_s=rate_bytes_per_s, poll_s=0.05),
            on_behind=self._behind,
        )
        self.rep.start()

    @classmethod
    def for_node(
        cls, ctx: NodeContext, cluster: Cluster, ranks: Callable[[], list[int]]
    ) -> NodeReplicas | None:
        """The node's replicas when ``--replica-rate`` is set (None: off)."""
        cfg = ctx.cfg
        if cfg.replica_rate_mb_s <= 0:
            return None

        def note(why: str) -> None:
            ctx.say(why)
            ctx.events.emit("note", message=why)

        rate = cfg.replica_rate_mb_s * 1e6
        return cls(cluster, ranks, note, host=cfg.node_address, rate_bytes_per_s=rate)

    def _behind(self, why: str) -> None:
        self._note(why)

    def _sources(self) -> dict[str, str]:
        return {self.names.replica(rank): self.names.rank_dir(rank) for rank in self._ranks()}

    def _buddy_address(self) -> tuple[str, int] | None:
        """Called by the replicator thread before each round; re-read once a second."""
        now = time.monotonic()
        if now - self._looked < 1.0:
            return self._buddy[1] if self._buddy else None
        self._looked = now
        try:
            buddy = ring_successor(self._node, self._cluster.live_nodes())
            kv = self._cluster.store.get(f"{self._key}{buddy}") if buddy is not None else None
        except Exception:  # the store is away for a moment: keep the last answer
            return self._buddy[1] if self._buddy else None
        if buddy is None or kv is None:
            self._buddy = None
            return None
        doc = json.loads(kv.value)
        address = (str(doc["host"]), int(doc["port"]))
        if self._buddy != (buddy, address):
            self._buddy = (buddy, address)
            self.rep.forget_sent()  # a new buddy has nothing yet
        self.rep.set_sources(self._sources())  # adopted ranks are replicated too
        return address

    def take_over(self, ranks: list[int]) -> dict[int, int]:
        """Make the replicas of ``ranks`` (a lost node's) their own slots here; returns
        rank -> replicated step for the ranks taken over (all of them, or none: a
        partial take-over would only make the restore pick an older common step)."""
        found: dict[int, int] = {}
        for rank in ranks:
            directory = self.names.replica_dir(rank)
            with contextlib.suppress(Exception):
                latest = latest_complete(directory, slot_count(directory))
                if latest is not None:
                    found[rank] = latest[1].step
        if len(found) != len(ranks):
            return {}
        sources: dict[int, str] = {}
        try:  # a transfer in flight into a copy (its sender hung) is cut, not waited for
            for rank in ranks:
                sources[rank] = self.rx.release(self.names.replica(rank))
        except TransferError as err:
            self._behind(f"replica takeover of ranks {ranks} abandoned: {err}")
            return {}
        for rank, src in sources.items():
            dst = self.names.rank_dir(rank)
            shutil.rmtree(dst, ignore_errors=True)
            os.rename(src, dst)
            write_replica_marker(dst, {"step": found[rank], "by": self._node})
        return found

    def close(self) -> None:
        self.rep.close()
        received = self.rx.namespaces()
        self.rx.close()
        for namespace in received:
            shutil.rmtree(self.names.directory(namespace), ignore_errors=True)
