"""Framing, handshake and pacing of the snapshot transfer protocol (docs/transfer.md).

Control frames are the coordinator's (``length | MAC | JSON``, helpers reused from
:mod:`stalwart.coordinator.wire`); chunk payloads follow their (MAC'd) chunk header as
raw bytes, so that they can go from the sender's mapping to the receiver's mapping with
``sendfile`` / ``recv_into`` and no copy in Python. The handshake uses its own role and
key labels, so a transfer frame is never valid in the store protocol or the reverse.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator.errors import FrameTooLargeError, ProtocolError
from stalwart.transfer.errors import TransferAuthError, TransferError, TransferProtocolError

__all__ = ["PROTOCOL", "VERSION", "Pacer"]

PROTOCOL = "stalwart-transfer"
VERSION = 1
CONTROL_MAX = 64 * 1024  # every control frame but the slot meta
_NONCE = 16


def _session_key(token: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(token, b"stalwart-transfer-session" + ns + nc, hashlib.sha256).digest()


class Channel:
    """One authenticated connection: MAC'd JSON frames in both directions plus raw
    payload bytes. ``side`` is ``b"C"`` (sender) or ``b"S"`` (receiver)."""

    def __init__(
        self, sock: socket.socket, key: bytes, side: bytes, frame_timeout: float | None = None
    ) -> None:
        self.sock = sock
        self.frame_timeout = frame_timeout  # a started frame must arrive in full within this
        self._key = key
        self._out = side
        self._in = b"S" if side == b"C" else b"C"
        self._seq_out = 0
        self._seq_in = 0

    def send(self, obj: dict[str, Any]) -> None:
        self.send_raw(wire.encode(obj))

    def send_raw(self, body: bytes) -> None:
        mac = wire.frame_mac(self._key, self._out, self._seq_out, body)
        self._seq_out += 1
        wire.send_frame(self.sock, mac, body)

    def recv_raw(self, max_bytes: int = CONTROL_MAX) -> bytes:
        mac, body = _recv(self.sock, max_bytes, self.frame_timeout)
        if not wire.mac_ok(wire.frame_mac(self._key, self._in, self._seq_in, body), mac):
            raise TransferAuthError("a frame failed its MAC: the peer is not this job's peer")
        self._seq_in += 1
        return body

    def recv(self, expect: str | tuple[str, ...]) -> dict[str, Any]:
        obj = decode(self.recv_raw())
        kinds = (expect,) if isinstance(expect, str) else expect
        if obj.get("type") not in kinds:
            raise TransferProtocolError(
                f"expected a {'/'.join(kinds)} frame, got {str(obj.get('type'))[:40]!r}"
            )
        return obj


def _recv(
    sock: socket.socket,
    max_bytes: int,
    frame_timeout: float | None = None,
    deadline: float | None = None,
) -> tuple[bytes, bytes]:
    try:
        return wire.recv_frame(sock, max_bytes + wire.MAC_SIZE, frame_timeout, deadline=deadline)
    except FrameTooLargeError as err:
        raise TransferProtocolError(f"{err}; the peer is not a stalwart transfer peer") from None
    except ProtocolError as err:
        raise TransferProtocolError(str(err)) from None


def decode(body: bytes) -> dict[str, Any]:
    try:
        return wire.decode(body)
    except ProtocolError as err:
        raise TransferProtocolError(str(err)) from None


def field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    try:
        return wire.field(obj, name, kind)
    except ProtocolError as err:
        raise TransferProtocolError(f"{obj.get('type', 'frame')}: {err}") from None


def server_handshake(
    sock: socket.socket, token: bytes, deadline: float, frame_timeout: float
) -> Channel:
    """Receiver side: greet, check the sender's proof of the token, prove ours. The
    sender's answer must arrive in full by ``deadline`` (``time.monotonic()``); the
    channel's later frames each within ``frame_timeout`` once started."""
    ns = os.urandom(_NONCE)
    hello = {"type": "hello", "protocol": PROTOCOL, "versions": [VERSION], "nonce": wire.b64e(ns)}
    wire.send_frame(sock, wire.ZERO_MAC, wire.encode(hello))
    mac, body = _recv(sock, 4096, deadline=deadline)
    auth = decode(body)
    if auth.get("type") != "auth":
        raise TransferProtocolError("the peer did not answer the hello with 'auth'")
    if auth.get("v") != VERSION or isinstance(auth.get("v"), bool):
        refuse(sock, "unsupported_version", f"transfer protocol {auth.get('v')!r}; speak 1")
        raise TransferProtocolError(f"peer speaks transfer protocol {auth.get('v')!r}, not 1")
    try:
        nc = wire.b64d(auth.get("nonce"), "nonce")
    except ProtocolError as err:
        raise TransferProtocolError(str(err)) from None
    if len(nc) != _NONCE or not wire.mac_ok(wire.auth_mac(token, b"tc", ns, nc, body), mac):
        refuse(sock, "auth_failed", "wrong job token")
        raise TransferAuthError("a peer failed the handshake: it does not hold the job token")
    ok = wire.encode({"type": "auth_ok", "v": VERSION})
    wire.send_frame(sock, wire.auth_mac(token, b"ts", ns, nc, ok), ok)
    return Channel(sock, _session_key(token, ns, nc), b"S", frame_timeout)


def client_handshake(sock: socket.socket, token: bytes) -> Channel:
    """Sender side: answer the hello and check that the receiver holds the token too."""
    _, body = _recv(sock, 4096)
    hello = decode(body)
    if hello.get("type") == "error":  # turned away before the handshake (connection limit)
        code, message = str(hello.get("code"))[:40], str(hello.get("message"))[:200]
        raise TransferProtocolError(f"receiver refused the connection: {message} [{code}]")
    if hello.get("type") != "hello" or hello.get("protocol") != PROTOCOL:
        raise TransferProtocolError(
            "the peer did not greet as a stalwart transfer receiver; wrong address?"
        )
    if VERSION not in (hello.get("versions") or []):
        raise TransferProtocolError(f"receiver speaks versions {hello.get('versions')}, not 1")
    try:
        ns = wire.b64d(hello.get("nonce"), "nonce")
    except ProtocolError as err:
        raise TransferProtocolError(str(err)) from None
    nc = os.urandom(_NONCE)
    auth = wire.encode({"type": "auth", "v": VERSION, "nonce": wire.b64e(nc)})
    wire.send_frame(sock, wire.auth_mac(token, b"tc", ns, nc, auth), auth)
    mac, body = _recv(sock, 4096)
    if not wire.mac_ok(wire.auth_mac(token, b"ts", ns, nc, body), mac):
        reply = decode(body)
        if reply.get("code") == "auth_failed":
            raise TransferAuthError(
                "the receiver refused our job token; both sides must read the same token file"
            )
        raise TransferAuthError("the receiver could not prove it holds the job token")
    return Channel(sock, _session_key(token, ns, nc), b"C")


def refuse(sock: socket.socket, code: str, message: str) -> None:
    """Tell an unauthenticated peer why it is turned away (zero MAC: no key yet)."""
    try:
        body = wire.encode({"type": "error", "code": code, "message": message})
        wire.send_frame(sock, wire.ZERO_MAC, body)
    except OSError:
        pass


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (MSG_WAITALL: one syscall per socket-buffer refill)."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise TransferProtocolError(f"peer closed the connection {n - got} bytes into a chunk")
        got += k


class Pacer:
    """Token bucket for the bandwidth cap of background replication.

    ``take(n)`` sleeps until ``n`` more bytes fit under ``rate`` bytes/s, allowing a burst
    of ``burst_s`` seconds of rate. ``clock``/``sleep`` are injectable so that the pacing
    logic is tested in-process without timing thresholds.
    """

    def __init__(
        self,
        rate: float,
        *,
        burst_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate > 0:
            raise TransferError(f"bandwidth cap {rate!r} bytes/s: use a positive number or None")
        self.rate = float(rate)
        self.burst = max(1.0, rate * burst_s)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()

    @property
    def piece(self) -> int:
        """Bytes to send between two ``take`` calls: one burst, at least 64 KiB."""
        return max(64 * 1024, int(self.burst))

    def take(self, n: int) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        if self._tokens < 0:
            self._sleep(-self._tokens / self.rate)
