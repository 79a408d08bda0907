"""A real etcd with TLS (client certificates required) and auth enabled, as a cluster
would run it: certificates made by ``trustme`` in the test, a ``root`` user, and one
user per job whose role grants readwrite on that job's prefix only (docs/etcd.md)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import trustme

from .etcd_server import EtcdServer, ServerTls, running_etcd

__all__ = ["SecureEtcd", "running_secure_etcd"]

PASSWORD = "s3cret-job7-password"


@dataclass
class SecureEtcd:
    server: EtcdServer
    tls: ServerTls
    dir: Path
    user: str
    password_file: str
    other_ca: str  # a CA that did not sign etcd's certificate

    @property
    def port(self) -> int:
        return self.server.client_port

    def url(self, job: str = "job7", **query: str) -> str:
        """``etcds://`` URL for ``job`` with the job user's credentials (``query``
        overrides; an empty value drops a parameter)."""
        params = {
            "ca": self.tls.ca,
            "cert": self.tls.client_cert,
            "key": self.tls.client_key,
            "user": self.user,
            "password-file": self.password_file,
            **query,
        }
        text = "&".join(f"{k}={v}" for k, v in params.items() if v)
        return f"etcds://127.0.0.1:{self.port}/{job}" + (f"?{text}" if text else "")

    def job_url(self, job: str) -> str:
        """``etcds://`` URL for ``job`` logged in as its own user (one of ``jobs`` of
        :func:`running_secure_etcd`), whose role grants that job's prefix only."""
        return self.url(job, user=job)


def _call(tls: ServerTls, port: int, path: str, body: dict[str, object]) -> None:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls.client_context())
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (path, data)
    finally:
        conn.close()


def _prefix_grant(job: str) -> dict[str, str]:
    key = f"/stalwart/{job}/".encode()
    end = key[:-1] + bytes([key[-1] + 1])
    return {
        "permType": "READWRITE",
        "key": base64.b64encode(key).decode(),
        "range_end": base64.b64encode(end).decode(),
    }


def enable_auth(tls: ServerTls, port: int, jobs: list[str]) -> None:
    """root (a random password nobody keeps) plus a user and role per job; auth on."""
    _call(tls, port, "/v3/auth/user/add", {"name": "root", "password": os.urandom(16).hex()})
    _call(tls, port, "/v3/auth/user/grant", {"user": "root", "role": "root"})
    for job in jobs:
        _call(tls, port, "/v3/auth/user/add", {"name": job, "password": PASSWORD})
        _call(tls, port, "/v3/auth/role/add", {"name": job})
        _call(tls, port, "/v3/auth/role/grant", {"name": job, "perm": _prefix_grant(job)})
        _call(tls, port, "/v3/auth/user/grant", {"user": job, "role": job})
    _call(tls, port, "/v3/auth/enable", {})


@contextlib.contextmanager
def running_secure_etcd(token_ttl: int = 300, jobs: Sequence[str] = ()) -> Iterator[SecureEtcd]:
    """etcd on loopback with TLS, client certificates and auth; a user and a role per job
    (``job7``, ``job8`` and ``jobs``), all with the same password file."""
    with tempfile.TemporaryDirectory(prefix="stalwart-etcd-pki-") as tmp:
        d = Path(tmp)
        ca = trustme.CA()
        server_cert = ca.issue_cert("127.0.0.1", "localhost")
        client_cert = ca.issue_cert("stalwart-client.invalid")  # no CommonName
        ca.cert_pem.write_to_path(str(d / "ca.pem"))
        server_cert.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
        server_cert.private_key_pem.write_to_path(str(d / "server.key"))
        client_cert.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
        client_cert.private_key_pem.write_to_path(str(d / "client.key"))
        trustme.CA().cert_pem.write_to_path(str(d / "other-ca.pem"))
        password_file = d / "password"
        password_file.write_text(PASSWORD + "\n")
        password_file.chmod(0o600)
        tls = ServerTls(
            cert=str(d / "server.pem"),
            key=str(d / "server.key"),
            ca=str(d / "ca.pem"),
            client_cert=str(d / "client.pem"),
            client_key=str(d / "client.key"),
            token_ttl=token_ttl,
        )
        with running_etcd(tls) as server:
            enable_auth(tls, server.client_port, ["job7", "job8", *jobs])
            yield SecureEtcd(server, tls, d, "job7", str(password_file), str(d / "other-ca.pem"))
