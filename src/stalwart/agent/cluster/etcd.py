"""The agent's side of ``--rdzv etcd://host:port/job-id``.

Every agent is a plain etcd client: nobody hosts the coordinator, so any node may be
lost. The job token (which authenticates the snapshot replica streams and peer
watches between agents) never sits in etcd where a client without the job's
credentials could read it (docs/security.md):

* with ``--token-file FILE`` (the same file on every node, e.g. a Kubernetes Secret)
  etcd holds only a verifier of it (``launch/token-check``, a SHA-256), which lets
  agents and workers find out that they were given different files;
* without one, the token is created once by whichever agent comes first (a
  compare-and-swap on ``launch/token``) and read from etcd by the others, and only
  after checking that a client without credentials is refused the job's keys
  (etcd auth with a role per job prefix, or client certificates): etcd's access
  control is then the job's.
"""

from __future__ import annotations

import os
import secrets
import time

from stalwart.agent.config import LaunchConfig
from stalwart.coordinator import (
    Compare,
    EtcdStore,
    EtcdStoreConfig,
    Put,
    StoreError,
    StoreUnavailableError,
    TokenFileError,
    check_token,
    create_token_file,
    read_token_file,
)
from stalwart.errors import ConfigError
from stalwart.logs import get_logger

__all__ = ["ETCD_RIDE_OUT_S", "agent_etcd_config", "open_etcd", "rdzv_from_file"]


_MAX_CONF_BYTES = 64 * 1024
_log = get_logger(__name__)

ETCD_RIDE_OUT_S = 10.0
"""The shortest an agent keeps retrying an etcd that does not answer: a restart of a
single member or a leader election (under a second in a 3-member cluster) is ridden
out; longer, this node takes itself for cut from etcd (its lease expired there)."""


def agent_etcd_config(lease_s: float) -> EtcdStoreConfig:
    """How long an agent's etcd call may take, bounded by the lease as the embedded
    store's are (agent/cluster/_link.py): a reply within half the lease (at least 1 s: etcd
    fsyncs every write), retries for two leases and at least :data:`ETCD_RIDE_OUT_S`.
    A node cut from etcd then learns it within ``max(3 x lease, lease/2 + 10 s)`` plus
    under a second of backoff and exits 3, not after a 30 s request and a 60 s
    reconnect (docs/etcd.md)."""
    half = max(1.0, lease_s / 2)
    reconnect = max(ETCD_RIDE_OUT_S, 2 * lease_s)
    marker = int(max(300, 4 * reconnect))  # exactly-once retries: twice the reconnect at least
    return EtcdStoreConfig(
        connect_timeout=half, request_timeout=half, reconnect_timeout=reconnect, marker_ttl=marker
    )


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
    # a restart or an election is ridden out; a node cut from etcd is fenced soon after
    store = EtcdStore.from_url(cfg.rdzv, agent_etcd_config(cfg.node_lease_s))
    try:
        _reach(store, cfg)
        if cfg.token_file:
            token = _shared_token_file(cfg.token_file, cfg.start_timeout_s)
            check_token(store, cfg.job, token, cfg.token_file, create=True)
            return store, token
        _refuse_open_etcd(store, cfg.job)
        key = f"/stalwart/{cfg.job}/launch/token"
        token = secrets.token_hex(32).encode("ascii")
        store.txn([Compare(key, "mod_revision", "==", 0)], [Put(key, token)])
        kv = store.get(key)
        assert kv is not None
        return store, kv.value
    except BaseException:
        store.close()
        raise


def _reach(store: EtcdStore, cfg: LaunchConfig) -> None:
    """The first answer from etcd: each ping gives up after the agent's bounded
    reconnect; at start etcd may take up to ``--start-timeout`` to come up, said once
    past 10 s (StoreUnavailableError after that)."""
    start = time.monotonic()
    said = False
    while True:
        try:
            store.ping()
            return
        except StoreUnavailableError:
            waited = time.monotonic() - start
            if waited > cfg.start_timeout_s:
                raise
            if not said and waited > 10.0:
                said = True
                until = time.strftime(
                    "%H:%M:%S", time.localtime(time.time() + cfg.start_timeout_s - waited)
                )
                where = ",".join(f"{h}:{p}" for h, p in store.endpoints)
                _log.info("waiting for etcd at %s until %s", where, until)


def _shared_token_file(path: str, timeout: float) -> bytes:
    """The token in ``path``, created (0600) when absent: on a shared file system the
    first agent writes it and the others, racing, read what it wrote."""
    if not os.path.exists(path):
        try:
            return create_token_file(path)
        except TokenFileError:
            pass  # another agent created it first
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read_token_file(path)
        except TokenFileError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # created by a racing agent, its content not yet written


def _refuse_open_etcd(store: EtcdStore, job: str) -> None:
    """ConfigError when a client without credentials can read the job's keys: the
    token stored there would be anyone's."""
    stranger = EtcdStore(
        store.endpoints,
        store.namespace,
        EtcdStoreConfig(
            connect_timeout=2.0, request_timeout=5.0, reconnect_timeout=2.0, marker_ttl=4
        ),
        security=store.security.anonymous(),
    )
    try:
        stranger.ping()
    except StoreError:
        return  # refused (auth, permission or TLS): only the job's credentials read it
    finally:
        stranger.close()
    raise ConfigError(
        f"etcd at {','.join(f'{h}:{p}' for h, p in store.endpoints)} lets clients without "
        f"credentials read job {job}'s keys, where the job token would be stored: give every "
        "node the same --token-file (etcd then holds only its hash), or enable etcd auth "
        "with a role for the job's prefix (docs/etcd.md, docs/security.md)"
    )
