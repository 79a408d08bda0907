"""How an agent reaches the job's store: it hosts it (node 0 of the embedded store, as
torchrun's node 0 hosts the c10d store), connects to node 0's with calls bounded by
the lease, or is an etcd client.

Bounded calls: a node cut from the coordinator must learn it within about its lease,
not after a 30 s request timeout plus a 30 s reconnect (agent/cluster/_fencing.py says what it
does then). Waits at start longer than 10 s say what they wait for and until when.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from stalwart.agent.config import LaunchConfig
from stalwart.coordinator import (
    StoreClient,
    StoreClientConfig,
    StoreServer,
    StoreServerConfig,
    StoreUnavailableError,
    create_token_file,
    read_token_file,
)
from stalwart.errors import ConfigError
from stalwart.logs import get_logger

__all__ = [
    "FENCE_BOUND_LEASES",
    "Link",
    "Waiting",
    "agent_client_config",
    "max_connections",
    "open_link",
]

_log = get_logger(__name__)

FENCE_BOUND_LEASES = 3.0
"""A node cut from the coordinator gives up within this many leases of its last answer
(plus < 1 s of backoff), then stops its workers and exits 3 (docs/launch.md): a first
attempt times out after half a lease, retries go on for two more leases, and the last
one may take half a lease again."""


def agent_client_config(lease_s: float) -> StoreClientConfig:
    """How long an agent's store call may take: a reply within half the lease (a probe
    before a recovery never sits 30 s in one call), and a coordinator that does not
    answer for two leases is given up (StoreUnavailableError, then exit 3: our lease
    expired there long before). Two, not one: a coordinator host descheduled for a
    moment renews every lease when it runs again (coordinator/_stall.py), and a retried
    request takes effect once (its request id). Together: :data:`FENCE_BOUND_LEASES`."""
    return StoreClientConfig(
        connect_timeout=max(0.2, lease_s / 2),
        request_timeout=max(0.2, lease_s / 2),
        reconnect_timeout=max(0.5, 2 * lease_s),
    )


class Link(NamedTuple):
    server: StoreServer | None  # node 0 of the embedded store: the server it hosts
    store: Any  # a Store: MemoryStore, StoreClient or EtcdStore
    token: bytes
    address: str


class Waiting:
    """A wait says, once past 10 s, what it waits for and until when (one line)."""

    def __init__(
        self, what: str, deadline: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what, self.deadline, self.clock = what, deadline, clock
        self.start = clock()
        self.said = False

    def tick(self) -> None:
        now = self.clock()
        if not self.said and now - self.start > 10.0:
            self.said = True
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + self.deadline - now))
            _log.info("waiting for %s until %s", self.what, until)


def max_connections(cfg: LaunchConfig) -> int:
    """The embedded store's connection cap for this job: each agent holds a pool of up
    to 4 (a watch long-poll among them), each worker one client and a generation
    watch. The default 512 refused the job's own members past ~25 nodes of 8 ranks
    (docs/scale.md)."""
    return max(512, cfg.nnodes * (4 + 3 * cfg.nproc_per_node) + 64)


def open_link(cfg: LaunchConfig, token_file: str) -> Link:
    host, port = cfg.endpoint()
    if cfg.etcd:
        from stalwart.agent.cluster.etcd import open_etcd

        store, token = open_etcd(cfg)
        return Link(None, store, token, str(cfg.rdzv))
    if cfg.node_rank == 0:
        if not os.path.exists(token_file):
            create_token_file(token_file)
        token = read_token_file(token_file)
        conf = StoreServerConfig(
            host=host,
            port=port,
            max_connections=max_connections(cfg),
            # every node's agent and workers connect at once when the job forms: 64
            # handshakes at a time evicted each other at 1,024 nodes (docs/scale.md)
            max_unauthenticated=max(64, 2 * cfg.nnodes),
        )
        server = StoreServer(token, conf).start()
        return Link(server, server.store, token, f"{host}:{server.port}")
    deadline = time.monotonic() + cfg.start_timeout_s
    waiting = Waiting(f"node 0's store at {host}:{port} and its job token", deadline)
    while not os.path.exists(token_file):
        waiting.tick()
        if time.monotonic() > deadline:
            raise ConfigError(
                f"no job token at {token_file}; pass --token-file (node 0 writes RUN_DIR/token)"
            )
        time.sleep(0.05)
    time.sleep(0.05)  # node 0 writes the file, then its content
    token = read_token_file(token_file)
    client = StoreClient(host, port, token, agent_client_config(cfg.node_lease_s))
    while True:  # each call gives up after two leases; the start may wait longer
        try:
            client.ping()
            return Link(None, client, token, f"{host}:{port}")
        except StoreUnavailableError:
            waiting.tick()
            if time.monotonic() > deadline:
                client.close()
                raise
