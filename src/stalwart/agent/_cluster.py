"""Node-level membership: the job's store, the launch record, and node leases.

Node 0's agent hosts the store (a :class:`StoreServer` over its in-process
:class:`MemoryStore`, as torchrun's node 0 hosts the c10d store); the others connect to
``--rdzv-endpoint`` with the job token. Every agent joins as member ``node<k>`` with a
lease and heartbeats it; node 0 notices a node whose lease expired without the agent
saying goodbye (``agents-done/node<k>``) and treats it as a lost node.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from stalwart.agent.config import LaunchConfig
from stalwart.coordinator import (
    Coordinator,
    CoordinatorConfig,
    StoreClient,
    StoreServer,
    StoreServerConfig,
    create_token_file,
    read_token_file,
)
from stalwart.errors import ConfigError, StalwartError

__all__ = ["Cluster"]


class Cluster:
    def __init__(self, cfg: LaunchConfig, run_dir: str) -> None:
        self.cfg = cfg
        self.node = cfg.node_rank
        self.token_file = cfg.token_file or os.path.join(run_dir, "token")
        self.server: StoreServer | None = None
        self.store: Any = None
        self._member: Any = None
        self._known: set[int] = set()
        self._lost: set[int] = set()
        self._root = f"/stalwart/{cfg.job}"

    def start(self) -> None:
        cfg = self.cfg
        host, port = cfg.endpoint()
        if self.node == 0:
            if not os.path.exists(self.token_file):
                create_token_file(self.token_file)
            token = read_token_file(self.token_file)
            self.server = StoreServer(token, StoreServerConfig(host=host, port=port)).start()
            self.store = self.server.store
            self.address = f"{host}:{self.server.port}"
        else:
            deadline = time.monotonic() + cfg.start_timeout_s
            while not os.path.exists(self.token_file):
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"no job token at {self.token_file}; pass --token-file (node 0 "
                        "writes RUN_DIR/token)"
                    )
                time.sleep(0.05)
            time.sleep(0.05)  # node 0 writes the file, then its content
            self.store = StoreClient(host, port, read_token_file(self.token_file))
            self.store.ping()
            self.address = f"{host}:{port}"
        self.coord = Coordinator(
            self.store,
            CoordinatorConfig(
                job_id=cfg.job,
                lease_ttl=cfg.node_lease_s,
                heartbeat_interval=cfg.node_lease_s / 4,
            ),
        )
        self._member = self.coord.join(f"node{self.node}", node=str(self.node))
        self._member.start_heartbeat()

    # ---------------------------------------------------------------- launch record
    def publish(self, key: str, record: dict[str, Any]) -> None:
        self.store.put(f"{self._root}/launch/{key}", json.dumps(record).encode())

    def read(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            kv = self.store.get(f"{self._root}/launch/{key}")
            if kv is not None:
                return dict(json.loads(kv.value))
            if time.monotonic() > deadline:
                raise StalwartError(f"node 0 did not publish {key!r} within {timeout:.0f}s")
            time.sleep(0.02)

    # ---------------------------------------------------------------- node loss
    def lost_nodes(self) -> list[int]:
        """Nodes whose lease expired since the last call, without a goodbye (node 0)."""
        if self.node != 0:
            return []
        live = set()
        for member_id in self.coord.members():
            if member_id.startswith("node") and member_id[4:].isdigit():
                live.add(int(member_id[4:]))
        self._known |= live
        gone = sorted(self._known - live - self._lost)
        out = []
        for n in gone:
            if self.store.get(f"{self._root}/agents-done/node{n}") is None:
                out.append(n)
            self._lost.add(n)
        return out

    def close(self, *, goodbye: bool = True) -> None:
        """Leave the job. ``goodbye=False`` (a cordoned node) leaves like a lost node, so
        that node 0 adopts this node's ranks."""
        if goodbye:
            with contextlib.suppress(Exception):
                self.store.put(f"{self._root}/agents-done/node{self.node}", b"1")
        with contextlib.suppress(Exception):
            if self._member is not None:
                self._member.leave()
        if self.server is not None:
            # let the other agents say goodbye before the store goes away
            deadline = time.monotonic() + 10.0
            with contextlib.suppress(Exception):
                while time.monotonic() < deadline and any(
                    m.startswith("node") for m in self.coord.members()
                ):
                    time.sleep(0.05)
            self.server.stop()
        elif self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
