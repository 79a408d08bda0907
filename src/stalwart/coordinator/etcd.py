"""``EtcdStore``: the :class:`~stalwart.coordinator.store.Store` interface on a real etcd.

It talks to etcd >= 3.4 through its JSON gateway (``/v3/...`` on the client URL)
with the standard library only: no gRPC or protobuf dependency whose versions
could clash with torch's. The Store interface is etcd's own model, so most calls
map one to one (docs/etcd.md has the table).

Exactly-once writes. A write whose reply is lost (etcd restarted, connection
reset) may or may not have been applied, and resending a plain put would apply
it twice. So every write is sent as a transaction guarded by a *request marker*,
a key unique to this request (``{namespace}r/{client}/{seq}``)::

    if version(marker) == 0:               # not applied yet
        txn(user compares) then user ops + put(marker, "s")
                           else failure ops + put(marker, "f")
    else:
        range(marker)                      # applied: report that outcome

Resending the same body is then idempotent, and the marker tells which branch
ran and at which revision. Markers live outside the user's key range (so
``range("")`` never sees them), share their write's revision (so revisions count
exactly as in etcd), and hang on a per-client lease so they expire on their own.
Branches without ops write no marker: they write nothing, so re-running them is
harmless. Grants use a client-chosen lease id, making them idempotent too.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from stalwart.coordinator._etcd_http import Endpoint, GatewayClient, Reply
from stalwart.coordinator._etcd_security import EtcdSecurity
from stalwart.coordinator._etcd_url import EtcdTarget, etcd_url, parse_etcd_url
from stalwart.coordinator._etcd_watch import EtcdWatch
from stalwart.coordinator._etcd_wire import (
    b64,
    compare_json,
    int_field,
    kv_from_json,
    op_json,
    prefix_end,
    unb64,
)
from stalwart.coordinator.errors import LeaseNotFoundError, ProtocolError
from stalwart.coordinator.memory import MAX_LEASE_TTL
from stalwart.coordinator.store import Compare, KeyValue, Op, Put, RangeResult, TxnResult
from stalwart.errors import ConfigError

__all__ = [
    "EtcdSecurity",
    "EtcdStore",
    "EtcdStoreConfig",
    "EtcdTarget",
    "etcd_url",
    "parse_etcd_url",
]


@dataclass(frozen=True)
class EtcdStoreConfig:
    """Timeouts of an :class:`EtcdStore` (seconds)."""

    connect_timeout: float = 5.0
    request_timeout: float = 30.0  # one HTTP exchange
    reconnect_timeout: float = 30.0  # keep retrying an unreachable etcd this long
    marker_ttl: int = 300  # lifetime of request markers; must exceed reconnect_timeout

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "request_timeout", "reconnect_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"EtcdStoreConfig.{name} must be > 0 seconds")
        if not self.marker_ttl >= 2 * self.reconnect_timeout:
            raise ConfigError(
                f"EtcdStoreConfig.marker_ttl ({self.marker_ttl}s) must be at least twice "
                f"reconnect_timeout ({self.reconnect_timeout}s) for exactly-once retries"
            )


def _check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"store keys are non-empty str, got {key!r}")
    return key.encode("utf-8")


class EtcdStore:
    """A :class:`Store` kept in etcd under ``namespace`` (e.g. ``/stalwart/job7/``).

    Thread-safe. Nothing is sent until the first call; :meth:`ping` checks the
    address early. ``job_id`` is set when built by :meth:`from_url`.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        namespace: str,
        config: EtcdStoreConfig | None = None,
        *,
        job_id: str = "",
        security: EtcdSecurity | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("EtcdStore needs at least one etcd endpoint (host, port)")
        if not namespace.endswith("/"):
            raise ConfigError(f"etcd namespace must end with '/', got {namespace!r}")
        self.config = config or EtcdStoreConfig()
        self.namespace = namespace
        self.job_id = job_id
        self._http = GatewayClient(
            [Endpoint(h, p) for h, p in endpoints],
            connect_timeout=self.config.connect_timeout,
            request_timeout=self.config.request_timeout,
            reconnect_timeout=self.config.reconnect_timeout,
            security=security,
        )
        self.endpoints = [(h, p) for h, p in endpoints]
        self._kp = f"{namespace}k/".encode()  # user keys
        self._marker_prefix = f"{namespace}r/{secrets.token_hex(8)}/"
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._marker_lease = 0
        self._marker_lease_at = 0.0
        self._watches: weakref.WeakSet[EtcdWatch] = weakref.WeakSet()

    @classmethod
    def from_url(cls, url: str, config: EtcdStoreConfig | None = None) -> EtcdStore:
        """``etcd[s]://host[:port][,host2[:port]...]/job-id[?options]`` -> a store for that
        job, with the URL's TLS and credentials (docs/etcd.md)."""
        target = parse_etcd_url(url)
        return cls(
            target.endpoints,
            target.namespace,
            config,
            job_id=target.job_id,
            security=target.security,
        )

    @property
    def security(self) -> EtcdSecurity:
        """How this store reaches etcd: TLS files and the etcd user (no secret)."""
        return self._http.security

    # -- keys and values ----------------------------------------------------

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        return self.txn([], [Put(key, value, lease)]).revision

    def get(self, key: str) -> KeyValue | None:
        doc = self._http.post("/v3/kv/range", {"key": b64(self._kp + _check_key(key))}, "get")
        kvs = doc.get("kvs") or []
        return kv_from_json(kvs[0], len(self._kp)) if kvs else None

    def range(self, prefix: str) -> RangeResult:
        key = self._kp + prefix.encode("utf-8")
        body = {"key": b64(key), "range_end": b64(prefix_end(key))}
        doc = self._http.post("/v3/kv/range", body, "range")
        kvs = [kv_from_json(kv, len(self._kp)) for kv in doc.get("kvs") or []]
        return RangeResult(kvs, _revision(doc))

    def delete(self, key: str, *, prefix: bool = False) -> int:
        raw = self._kp + _check_key(key)
        rng: dict[str, Any] = {"key": b64(raw)}
        if prefix:
            rng["range_end"] = b64(prefix_end(raw))
        # "some key exists in the range": every key there has version > 0, and an
        # empty range compares as one absent key (version 0). No key, no write.
        exists = {**rng, "target": "VERSION", "result": "GREATER", "version": "0"}
        ok, rev, inner = self._guarded([exists], [{"request_delete_range": rng}], [], "delete")
        if not ok:
            return 0
        if inner is not None:
            return int_field(inner[0].get("response_delete_range") or {}, "deleted")
        # Applied by an earlier attempt whose reply was lost: count what it removed.
        before = self._http.call("/v3/kv/range", {**rng, "revision": str(rev - 1)}, "delete")
        return int_field(before.doc, "count") if before.error is None else 1

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        cmp = [compare_json(c, self._kp + _check_key(c.key)) for c in compare]
        ok_ops = [op_json(op, self._kp + _check_key(op.key)) for op in success]
        fail_ops = [op_json(op, self._kp + _check_key(op.key)) for op in failure]
        succeeded, revision, _ = self._guarded(cmp, ok_ops, fail_ops, "txn")
        return TxnResult(succeeded, revision)

    # -- leases ---------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        # the same bound as the embedded store's: a lease that outlives a week is a member
        # that can never be declared lost (inf would also overflow the ceil below)
        if not 0 < ttl <= MAX_LEASE_TTL:  # also refuses NaN
            raise ValueError(
                f"lease ttl must be > 0 and <= {MAX_LEASE_TTL:.0f} seconds, got {ttl!r:.40}"
            )
        return self._grant(max(1, math.ceil(ttl)))

    def keepalive(self, lease: int) -> float:
        doc = self._http.post("/v3/lease/keepalive", {"ID": str(lease)}, "keepalive")
        ttl = int_field(doc.get("result") or {}, "TTL")
        if ttl <= 0:
            raise LeaseNotFoundError(
                f"keepalive: lease {lease} expired or was revoked; grant a new one (rejoin)"
            )
        return float(ttl)

    def time_to_live(self, lease: int) -> float | None:
        doc = self._http.post("/v3/lease/timetolive", {"ID": str(lease)}, "time_to_live")
        ttl = int_field(doc, "TTL")
        return None if ttl < 0 else float(ttl)

    def revoke(self, lease: int) -> bool:
        reply = self._http.call("/v3/lease/revoke", {"ID": str(lease)}, "revoke")
        if isinstance(reply.error, LeaseNotFoundError):
            return reply.resent  # gone now; if we resent, our first attempt revoked it
        _raise(reply)
        return True

    # -- watches and misc -------------------------------------------------------

    def watch(self, prefix: str, start_revision: int | None = None) -> EtcdWatch:
        key = self._kp + prefix.encode("utf-8")
        if start_revision is None:
            start_revision = self.ping() + 1
        elif start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        else:  # fail now, not at the first get, if that history is gone
            body = {"key": b64(key), "count_only": True, "revision": str(start_revision)}
            reply = self._http.call("/v3/kv/range", body, f"watch from {start_revision}")
            if reply.error is not None and "future revision" not in str(reply.error):
                raise reply.error
        watch = EtcdWatch(self._http, key, len(self._kp), start_revision)
        with self._lock:
            self._watches.add(watch)
        return watch

    def ping(self) -> int:
        """Round-trip to etcd; its current revision. StoreUnavailableError if unreachable."""
        body = {"key": b64(self._kp), "range_end": b64(prefix_end(self._kp)), "count_only": True}
        return _revision(self._http.post("/v3/kv/range", body, "ping"))

    def compact(self, revision: int) -> None:
        """Discard history before ``revision`` (operators and tests; etcd can also
        auto-compact). Watches from older revisions then raise CompactedError."""
        body = {"revision": str(revision), "physical": True}
        self._http.post("/v3/kv/compaction", body, "compact")

    def close(self) -> None:
        self._http.close()
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _grant(self, ttl: int) -> int:
        while True:
            lease_id = secrets.randbits(62) + 1
            body = {"ID": str(lease_id), "TTL": str(ttl)}
            reply = self._http.call("/v3/lease/grant", body, "grant")
            if reply.error is not None and "lease already exists" in str(reply.error):
                if reply.resent:
                    return lease_id  # our own earlier attempt created it
                continue  # a (2^-62) clash with someone else's lease id
            _raise(reply)
            return lease_id

    def _marker_lease_id(self) -> int:
        """This client's marker lease, renewed at half its TTL so a marker always
        outlives the retries of its request."""
        with self._lock:
            now = time.monotonic()
            if self._marker_lease and now - self._marker_lease_at < self.config.marker_ttl / 2:
                return self._marker_lease
        lease = self._grant(max(1, math.ceil(self.config.marker_ttl)))  # etcd takes whole seconds
        with self._lock:
            self._marker_lease, self._marker_lease_at = lease, now
        return lease

    def _guarded(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
        what: str,
    ) -> tuple[bool, int, list[dict[str, Any]] | None]:
        """Run a transaction exactly once; return (succeeded, revision, responses of
        the branch that ran, or None when an earlier attempt had applied it)."""
        if not success and not failure:  # read-only: safe to resend as is
            doc = self._http.post("/v3/kv/txn", {"compare": compare}, what)
            return bool(doc.get("succeeded")), _revision(doc), []
        while True:
            lease = self._marker_lease_id()
            marker = (self._marker_prefix + str(next(self._seq))).encode()

            inner = {
                "compare": compare,
                "success": _marked(success, marker, b"s", lease),
                "failure": _marked(failure, marker, b"f", lease),
            }
            body = {
                "compare": [{"key": b64(marker), "target": "VERSION", "version": "0"}],
                "success": [{"request_txn": inner}],
                "failure": [{"request_range": {"key": b64(marker)}}],
            }
            reply = self._http.call("/v3/kv/txn", body, what)
            if isinstance(reply.error, LeaseNotFoundError) and self._marker_lease_lost(lease):
                continue  # nothing was written; retry under a fresh marker lease
            _raise(reply)
            doc = reply.doc
            responses = doc.get("responses") or [{}]
            if doc.get("succeeded"):
                ran = responses[0].get("response_txn") or {}
                return bool(ran.get("succeeded")), _revision(doc), ran.get("responses") or []
            kvs = (responses[0].get("response_range") or {}).get("kvs") or []
            if not kvs:
                raise ProtocolError(f"{what}: etcd lost the request marker; retry the operation")
            return unb64(kvs[0].get("value")) == b"s", int_field(kvs[0], "mod_revision"), None

    def _marker_lease_lost(self, lease: int) -> bool:
        if self.time_to_live(lease) is not None:
            return False  # the missing lease is the caller's
        with self._lock:
            if self._marker_lease == lease:
                self._marker_lease = 0
        return True


def _marked(
    ops: list[dict[str, Any]], marker: bytes, value: bytes, lease: int
) -> list[dict[str, Any]]:
    """``ops`` plus the marker put that records this branch ran (none for no ops)."""
    put = {"key": b64(marker), "value": b64(value), "lease": str(lease)}
    return [*ops, {"request_put": put}] if ops else []


def _revision(doc: dict[str, Any]) -> int:
    return int_field(doc.get("header") or {}, "revision")


def _raise(reply: Reply) -> None:
    if reply.error is not None:
        raise reply.error
