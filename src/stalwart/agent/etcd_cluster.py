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

__all__ = ["open_etcd", "rdzv_from_file"]


_MAX_CONF_BYTES = 64 * 1024


def rdzv_from_file(path: str) -> str:
    """The etcd URL of a ``--rdzv-conf`` file: JSON, either ``{"url": "etcd://h:2379/job"}``
    or ``{"endpoints": ["h1:2379", "h2:2379"], "job": "job7"}``. Every problem (unreadable,
    over 64 KiB, not JSON, nested too deep, wrong shape, a bad URL) is one ``ConfigError``."""
    import json

    from stalwart.coordinator import parse_etcd_url
    from stalwart.errors import ConfigError

    example = '{"endpoints": ["10.0.0.5:2379", "10.0.0.6:2379"], "job": "job7"}'
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CONF_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"--rdzv-conf {path!r}: {err.strerror or err}") from None
    if len(raw) > _MAX_CONF_BYTES:
        raise ConfigError(f"--rdzv-conf {path!r} is over 64 KiB; expected {example}")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        why = "nested too deep" if isinstance(err, RecursionError) else str(err)
        raise ConfigError(f"--rdzv-conf {path!r} is not JSON ({why}); e.g. {example}") from None
    if isinstance(doc, dict) and isinstance(doc.get("url"), str):
        url = str(doc["url"])
    elif (
        isinstance(doc, dict)
        and isinstance(doc.get("endpoints"), list)
        and all(isinstance(e, str) for e in doc["endpoints"])
        and isinstance(doc.get("job"), str)
    ):
        url = f"etcd://{','.join(doc['endpoints'])}/{doc['job']}"
    else:
        raise ConfigError(f'--rdzv-conf {path!r}: expected {example} or {{"url": ...}}')
    parse_etcd_url(url)  # a one-line ConfigError naming what is wrong
    return url


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
