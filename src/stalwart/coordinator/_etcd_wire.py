"""JSON shapes of etcd's v3 gRPC gateway, and their mapping to the Store types.

The gateway speaks protobuf-as-JSON: ``bytes`` fields are base64, 64-bit
integers are decimal *strings*, enum defaults and zero values are omitted (an
event without ``type`` is a PUT, a kv without ``version`` has version 0). Every
decoder here therefore reads fields with a default instead of indexing, and
this module is the only place that knows those rules.
"""

from __future__ import annotations

import base64
from typing import Any

from stalwart.coordinator.errors import (
    AuthenticationError,
    CompactedError,
    LeaseNotFoundError,
    ProtocolError,
    StoreError,
)
from stalwart.coordinator.store import Compare, Delete, Event, KeyValue, Op, Put

__all__ = [
    "RETRYABLE_CODES",
    "EtcdApiError",
    "b64",
    "compare_json",
    "error_from_body",
    "event_from_json",
    "int_field",
    "kv_from_json",
    "op_json",
    "prefix_end",
    "unb64",
]

_TARGETS = {
    "mod_revision": ("MOD", "mod_revision"),
    "create_revision": ("CREATE", "create_revision"),
    "version": ("VERSION", "version"),
    "value": ("VALUE", "value"),
}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
# gRPC status codes etcd uses for "try again": DEADLINE_EXCEEDED ("request timed
# out"), RESOURCE_EXHAUSTED ("too many requests"), UNAVAILABLE ("no leader",
# "leader changed", "server stopped").
RETRYABLE_CODES = frozenset({4, 8, 14})


class EtcdApiError(StoreError):
    """etcd answered with an error we do not map to a more specific class."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object) -> bytes:
    if text is None or text == "":
        return b""
    if not isinstance(text, str):
        raise ProtocolError(f"etcd sent a non-string where base64 was expected: {text!r}")
    return base64.b64decode(text)


def int_field(doc: dict[str, Any], name: str) -> int:
    """A protobuf int64 field (a decimal string in JSON; absent means 0)."""
    value = doc.get(name, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"etcd sent {name}={value!r}, expected an integer") from None


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (etcd's range_end)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key
    return stripped[:-1] + bytes([stripped[-1] + 1])


def kv_from_json(doc: dict[str, Any], strip: int) -> KeyValue:
    """Decode an etcd ``mvccpb.KeyValue``; ``strip`` leading key bytes are the namespace."""
    return KeyValue(
        key=unb64(doc.get("key"))[strip:].decode("utf-8"),
        value=unb64(doc.get("value")),
        mod_revision=int_field(doc, "mod_revision"),
        create_revision=int_field(doc, "create_revision"),
        version=int_field(doc, "version"),
        lease=int_field(doc, "lease"),
    )


def event_from_json(doc: dict[str, Any], strip: int) -> Event:
    kv = kv_from_json(doc.get("kv") or {}, strip)
    if doc.get("type", "PUT") == "DELETE":
        return Event("delete", kv)
    return Event("put", kv)


def compare_json(cmp: Compare, key: bytes) -> dict[str, Any]:
    target, field = _TARGETS[cmp.target]
    operand = cmp.operand
    value: str = b64(operand) if isinstance(operand, bytes) else str(operand)
    return {"key": b64(key), "target": target, "result": _RESULTS[cmp.op], field: value}


def op_json(op: Op, key: bytes, lease: int | None = None) -> dict[str, Any]:
    """One ``RequestOp``; ``key`` is the namespaced key of ``op``."""
    if isinstance(op, Put):
        put: dict[str, Any] = {"key": b64(key), "value": b64(bytes(op.value))}
        lease = op.lease if lease is None else lease
        if lease:
            put["lease"] = str(lease)
        return {"request_put": put}
    assert isinstance(op, Delete)
    rng: dict[str, Any] = {"key": b64(key)}
    if op.prefix:
        rng["range_end"] = b64(prefix_end(key))
    return {"request_delete_range": rng}


def error_from_body(doc: dict[str, Any], what: str) -> StoreError:
    """Map a gateway error body to a Store error. Unary calls answer
    ``{"error", "code", "message"}``; streams (keepalive, watch) send
    ``{"error": {"grpc_code", "http_code", "message"}}``."""
    inner = doc.get("error")
    if isinstance(inner, dict):
        message = str(inner.get("message") or inner)
        code = inner.get("grpc_code")
    else:
        message = str(doc.get("message") or inner or doc)
        code = doc.get("code")
    code = code if isinstance(code, int) else -1
    if code == 7 or "permission denied" in message:
        return AuthenticationError(
            f"{what}: etcd denied access ({message}); pass the job's etcd user "
            "(--rdzv-user, --rdzv-password-file) whose role grants readwrite on the "
            "job's prefix /stalwart/JOB/ (docs/etcd.md)"
        )
    if "lease not found" in message:
        return LeaseNotFoundError(
            f"{what}: {message}; the lease expired or was revoked, grant a new one (rejoin)"
        )
    if "compacted" in message:
        return CompactedError(
            f"{what}: {message}; re-read the keys and watch from the current revision"
        )
    return EtcdApiError(f"{what}: etcd error {code}: {message}", code)
