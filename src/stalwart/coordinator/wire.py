"""Frames, MACs and JSON encodings of the store's wire protocol (docs/wire-protocol.md).

A frame is ``length (4 bytes, big-endian) | MAC (32 bytes) | JSON body``. The MAC
sits outside the JSON so that nothing has to be canonicalised: the receiver checks
the exact bytes it got before it parses them. Nothing here uses pickle; bytes
travel as base64 strings (as in etcd's JSON gateway).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import socket
import struct
import time
from typing import Any

from stalwart.coordinator.errors import (
    AuthenticationError,
    CompactedError,
    FrameTooLargeError,
    LeaseNotFoundError,
    ProtocolError,
    StoreError,
    StoreUnavailableError,
)
from stalwart.coordinator.store import Compare, Delete, Event, KeyValue, Op, Put

__all__ = [
    "MAC_SIZE",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "ZERO_MAC",
    "error_from_reply",
]

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAC_SIZE = 32
ZERO_MAC = bytes(MAC_SIZE)
NONCE_SIZE = 16
_HEADER = struct.Struct(">I")

# error code -> exception class raised by the client
_ERRORS: dict[str, type[StoreError]] = {
    "auth_failed": AuthenticationError,
    "unsupported_version": ProtocolError,
    "bad_frame": ProtocolError,
    "bad_request": ProtocolError,
    "too_large": FrameTooLargeError,
    "lease_not_found": LeaseNotFoundError,
    "compacted": CompactedError,
    "too_many_connections": StoreUnavailableError,
    "shutting_down": StoreUnavailableError,
    "internal": StoreError,
}
RETRYABLE_CODES = frozenset({"too_many_connections", "shutting_down"})


def error_from_reply(error: Any) -> StoreError:
    """Turn an ``{"code", "message"}`` error reply into the matching exception."""
    if not isinstance(error, dict):
        return ProtocolError(f"malformed error reply from the store server: {error!r}")
    code = str(error.get("code", "internal"))
    message = str(error.get("message", "no message"))
    return _ERRORS.get(code, StoreError)(f"store server: {message} [{code}]")


def code_for(exc: BaseException) -> str:
    """The wire error code for an exception raised while serving a request."""
    for code, cls in _ERRORS.items():
        if type(exc) is cls and code not in ("unsupported_version", "bad_frame"):
            return code
    if isinstance(exc, ValueError | TypeError | KeyError | ProtocolError):
        return "bad_request"
    return "internal"


# -- MACs --------------------------------------------------------------------


def auth_mac(
    token: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes, body: bytes
) -> bytes:
    """Handshake MAC: proves knowledge of the token, bound to both nonces."""
    return hmac.new(
        token, b"stalwart-auth-" + role + server_nonce + client_nonce + body, hashlib.sha256
    ).digest()


def session_key(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """Per-connection key; a frame captured on one connection is useless on another."""
    return hmac.new(
        token, b"stalwart-session" + server_nonce + client_nonce, hashlib.sha256
    ).digest()


def frame_mac(key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    """Per-frame MAC over direction and sequence number: no replay, reorder or reflection.
    ``hmac.digest``: OpenSSL's one-shot HMAC, no Python HMAC object per frame."""
    return hmac.digest(key, direction + seq.to_bytes(8, "big") + body, "sha256")


def mac_ok(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


# -- framing -------------------------------------------------------------------


def send_frame(sock: socket.socket, mac: bytes, body: bytes) -> None:
    sock.sendall(_HEADER.pack(MAC_SIZE + len(body)) + mac + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks: list[bytes] = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the frame did not arrive in full before its deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionResetError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(
    sock: socket.socket,
    max_bytes: int,
    frame_timeout: float | None = None,
    *,
    deadline: float | None = None,
) -> tuple[bytes, bytes]:
    """Read one frame; return ``(mac, body)``.

    With ``deadline`` (a ``time.monotonic()`` instant) the whole frame, its first byte
    included, must have arrived by then (a handshake). Otherwise the (possibly long)
    wait for a frame to start uses the socket's current timeout, and once its first
    byte arrives the *whole* frame must follow within ``frame_timeout``: a deadline for
    the frame, not for each ``recv``, so a peer dribbling a byte now and then cannot
    keep a half-frame, and the thread reading it, alive. Raises ``TimeoutError`` when
    a deadline passes.
    """
    timeout = sock.gettimeout()
    try:
        if deadline is not None:
            first = _recv_exact(sock, 1, deadline)
        else:
            first = sock.recv(1)
            if not first:
                raise ConnectionResetError("peer closed the connection")
            if frame_timeout is not None:
                deadline = time.monotonic() + frame_timeout
        (length,) = _HEADER.unpack(first + _recv_exact(sock, _HEADER.size - 1, deadline))
        if length > max_bytes:
            raise FrameTooLargeError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
        if length < MAC_SIZE:
            raise ProtocolError(f"frame of {length} bytes is shorter than its {MAC_SIZE}-byte MAC")
        data = _recv_exact(sock, length, deadline)
    finally:
        if deadline is not None:
            sock.settimeout(timeout)  # what the caller had, not the deadline's remainder
    return data[:MAC_SIZE], data[MAC_SIZE:]


# One encoder and one decoder for every frame: ``json.dumps``/``json.loads`` with options
# build a new one per call, a third of a small request's CPU in the server.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def encode(obj: dict[str, Any]) -> bytes:
    return _ENCODER.encode(obj).encode()


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a JSON number; send a finite number")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def decode(body: bytes) -> dict[str, Any]:
    """Parse a frame body: a JSON object whose numbers are finite.

    Anything else (not UTF-8, not JSON, ``NaN``/``Infinity``, a float that overflows,
    an integer of more than 4300 digits, nesting deeper than the parser's recursion
    limit) is a :class:`ProtocolError`, never another exception."""
    try:
        obj = _DECODER.decode(body.decode())
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ProtocolError(f"frame body is not JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise ProtocolError("frame body is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame body must be a JSON object, got {type(obj).__name__}")
    return obj


def number(obj: dict[str, Any], name: str, low: float, high: float, default: Any = ...) -> float:
    """``obj[name]`` as a number within ``[low, high]``; ProtocolError naming it otherwise."""
    value = field(obj, name, (int, float), default)
    if value is default and default is not ...:
        return float(value)
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not low <= as_float <= high:
        raise ProtocolError(f"field {name!r} must be between {low:g} and {high:g}")
    return as_float


# -- field access and type encodings ------------------------------------------------


def field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """``obj[name]`` checked against ``kind``; ProtocolError naming the field otherwise."""
    if name not in obj or obj[name] is None:
        if default is not ...:
            return default
        raise ProtocolError(f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ProtocolError(f"field {name!r} must be a number, got a boolean")
    if not isinstance(value, kind):
        raise ProtocolError(f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: Any, name: str = "value") -> bytes:
    if not isinstance(text, str):
        raise ProtocolError(f"field {name!r} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"field {name!r} is not valid base64") from None


def kv_to_json(kv: KeyValue) -> dict[str, Any]:
    return {
        "key": kv.key,
        "value": b64e(kv.value),
        "mod_revision": kv.mod_revision,
        "create_revision": kv.create_revision,
        "version": kv.version,
        "lease": kv.lease,
    }


def kv_from_json(obj: Any) -> KeyValue:
    if not isinstance(obj, dict):
        raise ProtocolError("a key-value must be a JSON object")
    return KeyValue(
        key=field(obj, "key", str),
        value=b64d(obj.get("value")),
        mod_revision=field(obj, "mod_revision", int),
        create_revision=field(obj, "create_revision", int),
        version=field(obj, "version", int),
        lease=field(obj, "lease", int, 0),
    )


def event_to_json(event: Event) -> dict[str, Any]:
    return {"type": event.type, "kv": kv_to_json(event.kv)}


def event_from_json(obj: Any) -> Event:
    if not isinstance(obj, dict) or obj.get("type") not in ("put", "delete"):
        raise ProtocolError(f"malformed event: {obj!r}")
    return Event(obj["type"], kv_from_json(obj.get("kv")))


def compare_to_json(cmp: Compare) -> dict[str, Any]:
    operand = b64e(cmp.operand) if isinstance(cmp.operand, bytes) else cmp.operand
    return {"key": cmp.key, "target": cmp.target, "op": cmp.op, "operand": operand}


def compare_from_json(obj: Any) -> Compare:
    if not isinstance(obj, dict):
        raise ProtocolError("a comparison must be a JSON object")
    target = field(obj, "target", str)
    op = field(obj, "op", str)
    if target not in ("mod_revision", "create_revision", "version", "value"):
        raise ProtocolError(f"unknown comparison target {target!r}")
    if op not in ("==", "!=", "<", ">"):
        raise ProtocolError(f"unknown comparison operator {op!r}")
    operand = (
        b64d(obj.get("operand"), "operand") if target == "value" else field(obj, "operand", int)
    )
    return Compare(field(obj, "key", str), target, op, operand)


def op_to_json(op: Op) -> dict[str, Any]:
    if isinstance(op, Put):
        return {"op": "put", "key": op.key, "value": b64e(op.value), "lease": op.lease}
    return {"op": "delete", "key": op.key, "prefix": op.prefix}


def op_from_json(obj: Any) -> Op:
    if not isinstance(obj, dict):
        raise ProtocolError("a transaction operation must be a JSON object")
    kind = obj.get("op")
    if kind == "put":
        return Put(field(obj, "key", str), b64d(obj.get("value")), field(obj, "lease", int, None))
    if kind == "delete":
        return Delete(field(obj, "key", str), field(obj, "prefix", bool, False))
    raise ProtocolError(f"unknown transaction operation {kind!r}")
