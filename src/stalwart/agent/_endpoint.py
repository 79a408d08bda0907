"""``--rdzv-endpoint HOST:PORT``: strict parsing, so a bad value is one line at start.

``HOST`` is a host name, an IPv4 address or a bracketed IPv6 literal (``[::1]:29500``);
an empty host means loopback. ``PORT`` is ASCII digits in 1..65535 (``isdigit()`` also
accepts ``²``, which ``int()`` then refuses with a traceback).
"""

from __future__ import annotations

import ipaddress
import re

from stalwart.errors import ConfigError

__all__ = ["parse_endpoint"]

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
