"""Parsing of ``etcd[s]://host[:port][,host[:port]...]/job-id[?tls options]`` rendezvous URLs.

Kept apart from the store so the launcher can validate a ``--rdzv`` value (and
print a one-line error) before it starts anything.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from stalwart.coordinator._etcd_security import EtcdSecurity
from stalwart.errors import ConfigError

__all__ = ["DEFAULT_PORT", "EtcdTarget", "etcd_url", "parse_etcd_url"]

DEFAULT_PORT = 2379
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
_MAX_ENDPOINTS = 64
_EXAMPLE = "etcd://host:2379/job-id (several endpoints: etcd://h1:2379,h2:2379/job-id)"
# query parameter -> EtcdSecurity field (docs/etcd.md, "TLS and authentication")
_QUERY = {
    "ca": "ca_file",
    "cert": "cert_file",
    "key": "key_file",
    "user": "user",
    "password-file": "password_file",
    "password-env": "password_env",
}


@dataclass(frozen=True)
class EtcdTarget:
    """Where a job's coordinator state lives: etcd endpoints and the job's key prefix."""

    endpoints: list[tuple[str, int]]
    job_id: str
    security: EtcdSecurity = field(default_factory=EtcdSecurity)

    @property
    def namespace(self) -> str:
        return f"/stalwart/{self.job_id}/"


def _bad(url: str, problem: str) -> ConfigError:
    shown = url if len(url) <= 300 else url[:300] + "..."
    shown = re.sub(r"(password=)[^&]*", r"\1***", re.sub(r"//[^/@]*@", "//***@", shown))
    return ConfigError(f"bad etcd URL {shown!r}: {problem}; expected {_EXAMPLE}")


def _endpoint(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):  # [ipv6]:port
        host, sep, rest = text[1:].partition("]")
        if not sep or not host or (rest and not rest.startswith(":")):
            raise _bad(url, f"endpoint {text!r} is not [ipv6]:port")
        try:  # what lands in the Host header and the socket address: a real literal
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(url, f"endpoint {text!r}: {host!r} is not an IPv6 address") from None
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
        if not _HOST.fullmatch(host):
            raise _bad(url, f"endpoint {text!r} has no valid host name")
    if not port_text:
        return host, DEFAULT_PORT
    port = int(port_text) if _PORT.fullmatch(port_text) else 0
    if not 0 < port < 65536:
        raise _bad(url, f"port {port_text!r} is not a number in 1..65535")
    return host, port


def parse_etcd_url(url: str) -> EtcdTarget:
    """Split an etcd rendezvous URL; ConfigError naming the problem if it is malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("etcd", "etcds"):
        raise _bad(url, "the scheme must be etcd:// (plain) or etcds:// (TLS)")
    rest, _, query = rest.partition("?")
    security = _security(url, scheme.lower() == "etcds", query)
    netloc, slash, path = rest.partition("/")
    if not netloc:
        raise _bad(url, "no etcd host")
    if "@" in netloc:
        raise _bad(url, "credentials in the URL are not supported")
    parts = netloc.split(",")
    if len(parts) > _MAX_ENDPOINTS:
        raise _bad(url, f"more than {_MAX_ENDPOINTS} endpoints")
    endpoints = [_endpoint(url, part.strip()) for part in parts]
    job_id = path.rstrip("/") if slash else ""
    if not job_id:
        raise _bad(url, "no job id after the host")
    if not _JOB_ID.fullmatch(job_id):
        raise _bad(
            url,
            f"job id {job_id!r} must be 1-128 letters, digits, '.', '_' or '-' "
            "(no '/'), starting with a letter or digit",
        )
    return EtcdTarget(endpoints, job_id, security)


def _security(url: str, tls: bool, query: str) -> EtcdSecurity:
    values: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _bad(url, "the query must be name=value pairs joined by '&'") from None
    for name, value in pairs:
        if name == "password":
            raise _bad(
                url,
                "a password in the URL is visible to every user (ps); "
                "use password-file= or password-env=",
            )
        if name not in _QUERY:
            raise _bad(url, f"unknown option {name!r} (known: {', '.join(_QUERY)})")
        if _QUERY[name] in values or not value or "\x00" in value:
            raise _bad(url, f"option {name!r} must be given once, non-empty")
        values[_QUERY[name]] = value
    return EtcdSecurity(tls=tls, **values)


def etcd_url(target: EtcdTarget) -> str:
    """The URL that parses back to ``target`` (how the launcher hands it to workers)."""
    from urllib.parse import quote, urlencode

    sec = target.security
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in target.endpoints)
    query = urlencode(sec.query(), quote_via=quote, safe="/")
    return f"{'etcds' if sec.tls else 'etcd'}://{hosts}/{target.job_id}" + (
        f"?{query}" if query else ""
    )
