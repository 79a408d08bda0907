"""The agent's side of ``--rdzv etcd://host:port/job-id``.

Every agent is a plain etcd client: nobody hosts the coordinator, so any node may be
lost. The job token (which authenticates the snapshot replica streams between agents)
is created once by whichever agent comes first, with a compare-and-swap on
``launch/token``, and read by the others: etcd's own access control is then the job's
(docs/etcd.md).
"""

from __future__ import annotations

import secrets

from stalwart.agent.config import LaunchConfig
from stalwart.coordinator import Compare, EtcdStore, EtcdStoreConfig, Put

__all__ = ["open_etcd"]


def open_etcd(cfg: LaunchConfig) -> tuple[EtcdStore, bytes]:
    """Connect to the job's etcd (StoreUnavailableError now if unreachable); the token."""
    assert cfg.rdzv is not None
    # agents ride out an etcd restart or leader election: retry for a minute
    store = EtcdStore.from_url(cfg.rdzv, EtcdStoreConfig(reconnect_timeout=60.0, marker_ttl=300))
    store.ping()
    key = f"/stalwart/{cfg.job}/launch/token"
    token = secrets.token_hex(32).encode("ascii")
    store.txn([Compare(key, "mod_revision", "==", 0)], [Put(key, token)])
    kv = store.get(key)
    assert kv is not None
    return store, kv.value
