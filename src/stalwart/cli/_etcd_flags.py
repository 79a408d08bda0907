"""The ``--rdzv-tls-*`` and ``--rdzv-user``/``--rdzv-password-*`` flags of ``stalwart
run`` and ``stalwart check``: folded into the etcd URL's query (docs/etcd.md), which
is how the agents hand the same TLS and credentials to every worker."""

from __future__ import annotations

import argparse
import dataclasses

from stalwart.errors import ConfigError

__all__ = ["add_etcd_security_flags", "refuse_without_rdzv", "with_security"]

# flag dest -> EtcdSecurity field
_FLAGS = {
    "rdzv_tls_ca": "ca_file",
    "rdzv_tls_cert": "cert_file",
    "rdzv_tls_key": "key_file",
    "rdzv_user": "user",
    "rdzv_password_file": "password_file",
    "rdzv_password_env": "password_env",
}


def add_etcd_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rdzv-tls-ca", default=None, help="PEM CA that signed etcd's cert (etcds://)")
    p.add_argument("--rdzv-tls-cert", default=None, help="PEM client certificate for etcd")
    p.add_argument("--rdzv-tls-key", default=None, help="PEM key of --rdzv-tls-cert")
    p.add_argument("--rdzv-user", default=None, help="etcd user (role: the job's key prefix)")
    p.add_argument(
        "--rdzv-password-file", default=None, help="file holding --rdzv-user's password (0600)"
    )
    p.add_argument(
        "--rdzv-password-env", default=None, help="environment variable holding the password"
    )


def with_security(url: str, args: argparse.Namespace) -> str:
    """``url`` with the flags' TLS and credentials in its query; ConfigError when a flag
    contradicts the URL or is given without an etcd URL."""
    from stalwart.coordinator import EtcdSecurity, etcd_url, parse_etcd_url

    given = {field: getattr(args, dest) for dest, field in _FLAGS.items() if getattr(args, dest)}
    if not given:
        return url
    target = parse_etcd_url(url)
    current = dataclasses.asdict(target.security)
    for field, value in given.items():
        if current[field] and current[field] != value:
            flag = "--" + next(d for d, f in _FLAGS.items() if f == field).replace("_", "-")
            raise ConfigError(f"{flag} {value!r} contradicts the etcd URL's {current[field]!r}")
        current[field] = value
    current["tls"] = bool(current["tls"] or current["ca_file"] or current["cert_file"])
    return etcd_url(dataclasses.replace(target, security=EtcdSecurity(**current)))


def refuse_without_rdzv(args: argparse.Namespace) -> None:
    """The etcd flags mean nothing without ``--rdzv``: say so rather than ignore them."""
    if any(getattr(args, dest) for dest in _FLAGS):
        raise ConfigError("--rdzv-tls-*/--rdzv-user/--rdzv-password-* need --rdzv etcd[s]://...")
