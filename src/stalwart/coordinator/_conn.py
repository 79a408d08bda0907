"""One connection of the store server's event loop (_loop.py): its non-blocking socket,
what it has received but not yet parsed, what it still has to send, its session, and
the deadline it is held to (the whole handshake, or the frame that has begun).

The frames and MACs are those of wire.py (docs/wire-protocol.md): this only cuts them
out of a byte stream instead of reading them with blocking calls.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from stalwart.coordinator import wire
from stalwart.coordinator.errors import FrameTooLargeError, ProtocolError

__all__: list[str] = []

_HEADER = 4
_RECV = 1 << 16


class Closed(Exception):
    """The peer closed the connection, or its socket failed."""


class Conn:
    """A connection's state. ``key`` is empty until the handshake proved the token."""

    __slots__ = (
        "active",
        "closing",
        "deadline",
        "host",
        "inbuf",
        "key",
        "nonce",
        "out",
        "peer",
        "rseq",
        "sock",
        "watch",
        "writing",
        "wseq",
    )

    def __init__(self, sock: socket.socket, peer: Any, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.host = str(peer[0])
        self.inbuf = bytearray()
        self.out = bytearray()
        self.key = b""
        self.nonce = os.urandom(wire.NONCE_SIZE)  # the server's handshake nonce
        self.rseq = self.wseq = 0
        self.deadline: float | None = None  # handshake or begun frame; None: none
        self.active = now  # the last frame received: the idle timeout counts from it
        self.watch: Any = None  # its parked long-poll, if any
        self.closing = False  # close once ``out`` is sent
        self.writing = False  # registered for EVENT_WRITE

    def receive(self) -> int:
        """Read what the socket has (never blocks); bytes read. Closed at EOF/error."""
        try:
            data = self.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise Closed from exc
        if not data:
            raise Closed
        self.inbuf += data
        return len(data)

    def frame(self, max_bytes: int) -> tuple[bytes, bytes] | None:
        """The next whole frame ``(mac, body)`` received, or None while incomplete.
        FrameTooLargeError / ProtocolError as soon as the length prefix is bad."""
        buf = self.inbuf
        if len(buf) < _HEADER:
            return None
        length = int.from_bytes(buf[:_HEADER], "big")
        if length > max_bytes:
            raise FrameTooLargeError(f"frame of {length} bytes exceeds the limit of {max_bytes}")
        if length < wire.MAC_SIZE:
            raise ProtocolError(
                f"frame of {length} bytes is shorter than its {wire.MAC_SIZE}-byte MAC"
            )
        end = _HEADER + length
        if len(buf) < end:
            return None
        mac = bytes(buf[_HEADER : _HEADER + wire.MAC_SIZE])
        body = bytes(buf[_HEADER + wire.MAC_SIZE : end])
        del buf[:end]
        return mac, body

    def queue(self, mac: bytes, body: bytes) -> bool:
        """Queue one frame and send what the socket takes now; True if some is left."""
        self.out += (len(body) + wire.MAC_SIZE).to_bytes(_HEADER, "big") + mac + body
        return self.flush()

    def reply(self, body: bytes) -> bool:
        """Queue a reply MAC'd with the session key (zero MAC before the handshake)."""
        mac = wire.frame_mac(self.key, b"S", self.wseq, body) if self.key else wire.ZERO_MAC
        if self.key:
            self.wseq += 1
        return self.queue(mac, body)

    def flush(self) -> bool:
        """Send what the socket takes now; True if some is left. Closed on error."""
        if not self.out:
            return False
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            raise Closed from exc
        del self.out[:sent]
        return bool(self.out)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def hello(conn: Conn) -> bytes:
    """The server's greeting: the versions it speaks and its nonce."""
    return wire.encode(
        {"type": "hello", "versions": list(wire.SUPPORTED_VERSIONS), "nonce": wire.b64e(conn.nonce)}
    )


class Refused(Exception):
    """A handshake refused: ``code`` and ``message`` for the error reply; ``auth``: a
    wrong token (counted as an authentication failure, not a rejected frame)."""

    def __init__(self, code: str, message: str, log: str, *, auth: bool = False) -> None:
        super().__init__(message)
        self.code, self.log, self.auth = code, log, auth


def check_auth(conn: Conn, token: bytes, mac: bytes, body: bytes) -> None:
    """Check the client's ``auth`` frame (Refused, ProtocolError), queue the MAC'd
    ``auth_ok`` and set the connection's session key."""
    msg = wire.decode(body)
    if msg.get("type") != "auth":
        raise ProtocolError(f"expected an 'auth' frame, got {msg.get('type')!r}")
    version = msg.get("v")
    if isinstance(version, bool) or version not in wire.SUPPORTED_VERSIONS:
        raise Refused(
            "unsupported_version",
            f"protocol version {version!r} not supported; this server speaks "
            f"{list(wire.SUPPORTED_VERSIONS)}; upgrade stalwart on both sides",
            f"store: %s speaks unsupported protocol version {version!r}",
        )
    client_nonce = wire.b64d(msg.get("nonce"), "nonce")
    if len(client_nonce) != wire.NONCE_SIZE or not wire.mac_ok(
        wire.auth_mac(token, b"c", conn.nonce, client_nonce, body), mac
    ):
        raise Refused(
            "auth_failed",
            "authentication failed: wrong job token",
            "store: authentication failed for %s (wrong job token?)",
            auth=True,
        )
    ok = wire.encode({"type": "auth_ok", "v": version})
    conn.queue(wire.auth_mac(token, b"s", conn.nonce, client_nonce, ok), ok)
    conn.key = wire.session_key(token, conn.nonce, client_nonce)
