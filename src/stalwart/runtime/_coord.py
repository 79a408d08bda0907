"""How a worker reaches the coordinator: the embedded store or etcd, and what etcd adds.

Under ``--rdzv etcd://...`` a worker talks to etcd itself (nothing on node 0), forms its
gloo groups over etcd too (:class:`CoordStoreC10d`), joins a generation only while its
agent's lease is alive (the *fence*: a compare on the agent's member key, so the
workers of a partitioned node can never rejoin under ranks that were adopted
elsewhere), and watches the generation: when a leader bumps it (a lost node's ranks
were adopted), live workers leave their old group at the next step boundary instead of
waiting for a collective to fail.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from stalwart.coordinator import Compare, Coordinator, Store, StoreClient
from stalwart.runtime.env import WorkerEnv

__all__ = ["GenerationWatch", "c10d_store", "fence_compares", "open_store"]


def open_store(env: WorkerEnv) -> Store:
    if env.rdzv:
        from stalwart.coordinator import EtcdStore, EtcdStoreConfig

        return EtcdStore.from_url(env.rdzv, EtcdStoreConfig(reconnect_timeout=60.0))
    assert env.store is not None
    return StoreClient.from_token_file(env.store[0], env.store[1], env.token_file)


def c10d_store(env: WorkerEnv, store: Store | None) -> Any:
    """The torch Store gloo forms groups over (None: the TCPStore at ``env.c10d``)."""
    if not env.rdzv or store is None:
        return None
    from stalwart.runtime._c10d_store import CoordStoreC10d

    return CoordStoreC10d(store, f"/stalwart/{env.job}/c10d/", timedelta(seconds=300))


def fence_compares(env: WorkerEnv) -> list[Compare]:
    """Compares that hold while this worker's agent still holds its lease."""
    node, sep, rev = env.fence.partition(":")
    if not sep or not rev.isdigit():
        return []
    key = f"/stalwart/{env.job}/members/node{node}"
    return [Compare(key, "create_revision", "==", int(rev))]


class GenerationWatch:
    """Polls the job's generation; :attr:`moved` is set once it passes ``current``."""

    def __init__(self, coord: Coordinator, interval_s: float = 0.2) -> None:
        self.coord = coord
        self.current = 0
        self.interval_s = interval_s
        self.moved = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-genwatch", daemon=True)
        self._thread.start()

    def follow(self, generation: int) -> None:
        self.current = generation
        self.moved.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.coord.generation() > self.current:
                    self.moved.set()
            except Exception:  # etcd away for a moment: the next poll tells
                continue

    def close(self) -> None:
        self._stop.set()
