"""The addresses of a node: the rendezvous endpoint it dials, the one it advertises to its
peers, and a start-time refusal of a host name that would make gloo bind loopback
(issue 25, item 7).

``--rdzv-endpoint HOST:PORT`` is parsed strictly (:func:`parse_endpoint`), so a bad
value is one line at start: ``HOST`` is a host name, an IPv4 address or a bracketed
IPv6 literal (``[::1]:29500``); an empty host means loopback. ``PORT`` is ASCII digits
in 1..65535 (``isdigit()`` also accepts ``²``, which ``int()`` then refuses with a
traceback).

Across hosts, a listener on 127.0.0.1 is reachable by nobody: the peer watch (the
sub-second detection of a dead agent) and the replica receiver must bind and advertise
an address the other hosts can route to. The default is the local address of the route
to the rendezvous (``--rdzv-endpoint``, or the first etcd endpoint): the interface the
job's control traffic already uses, so it is routable from the other nodes by
construction. ``--replica-host`` still overrides it (``$(POD_IP)`` in a pod).

gloo picks its own address from the host name (unless ``GLOO_SOCKET_IFNAME`` names an
interface); where the name resolves to loopback (Debian's installer maps it to
127.0.1.1) a job that spans hosts never forms its group and, without this check, says
nothing for minutes. torchrun needs ``GLOO_SOCKET_IFNAME`` there too.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct

from stalwart.errors import ConfigError

__all__ = [
    "c10d_store",
    "check_host_name",
    "listen_on",
    "node_address",
    "parse_endpoint",
    "resolve_node_address",
]

_SIOCGIFADDR = 0x8915


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _route_from(host: str, port: int) -> str:
    """The local address the kernel routes ``host`` through (no packet is sent: a UDP
    connect only picks the route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as err:
        raise ConfigError(
            f"rendezvous host {host!r} does not resolve ({err.strerror or err}); fix the "
            "name or pass its address"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as err:
            raise ConfigError(
                f"no route to the rendezvous host {host} ({err.strerror or err}); pass "
                "--replica-host ADDR (this node's address the other nodes reach)"
            ) from None
        return str(s.getsockname()[0])


def node_address(given: str | None, rendezvous: tuple[str, int] | None) -> str:
    """``--replica-host`` when given; else the address of the route to ``rendezvous``
    (None, or a loopback rendezvous: every node on this host, 127.0.0.1)."""
    if given:
        return given
    if rendezvous is None:
        return "127.0.0.1"
    return _route_from(*rendezvous)


def _interface_of(addr: str) -> str | None:
    """The name of the interface holding IPv4 ``addr`` (None: not found)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
                if socket.inet_ntoa(got[20:24]) == addr:
                    return name
    return None


def check_host_name(addr: str) -> None:
    """Refuse to start a node of a multi-host job (``addr``, its routable address, is not
    loopback) whose host name resolves to loopback while gloo would use it."""
    if _is_loopback(addr) or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = socket.gethostname()
    try:
        own = socket.gethostbyname(name)
    except OSError:
        own = ""
    if not _is_loopback(own):
        return
    iface = _interface_of(addr) or "IFACE"
    raise ConfigError(
        f"this host's name {name!r} resolves to {own} (loopback) but the job spans hosts "
        f"(this node reaches them from {addr}): gloo would listen on loopback and the group "
        f"never form; set GLOO_SOCKET_IFNAME={iface} or map {name} to {addr} in /etc/hosts"
    )


def listen_on(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` only, port chosen by the kernel (the c10d
    store's: docs/security.md says it binds the rendezvous host, not every interface)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def c10d_store(host: str) -> tuple[int, object]:
    """torch's c10d TCPStore (server side) listening on ``host`` only; (port, store).
    torch binds every interface when it opens the port itself, so the socket is opened
    here and handed over (``master_listen_fd``: the store owns the descriptor)."""
    from datetime import timedelta

    from stalwart.compat.torch_c10d import TCPStore

    lsock = listen_on(host)
    port = int(lsock.getsockname()[1])
    ttl = timedelta(seconds=300)
    store = TCPStore(host, port, None, True, ttl, False, master_listen_fd=lsock.detach())
    return port, store


def resolve_node_address(given: str, rendezvous: tuple[str, int] | None, spans: bool) -> str:
    """``given`` (``--replica-host``), else :func:`node_address` of ``rendezvous``; when
    the job ``spans`` more than one node, refuses first a host name that resolves to
    loopback (:func:`check_host_name`)."""
    addr = node_address(given, rendezvous)
    if rendezvous is not None and spans:
        check_host_name(addr)
    return addr


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ``ConfigError`` naming the problem and the form."""
    form = "expected HOST:PORT, e.g. 10.0.0.5:29500 or [fd00::5]:29500"
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ConfigError(f"--rdzv-endpoint {text!r}: no port; {form}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(
                f"--rdzv-endpoint {text!r}: {host} is not an IPv6 address; {form}"
            ) from None
        host = host[1:-1]
    elif host and not _HOST.fullmatch(host):
        raise ConfigError(f"--rdzv-endpoint {text!r}: {host!r} is not a host name; {form}")
    number = int(port) if _PORT.fullmatch(port) else 0
    if not 0 < number < 65536:
        raise ConfigError(f"--rdzv-endpoint {text!r}: port {port!r} is not in 1..65535; {form}")
    return host or "127.0.0.1", number
