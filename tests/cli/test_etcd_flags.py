"""The etcd TLS/auth flags fold into the rendezvous URL's query (docs/etcd.md), which
parses back to the same settings; secrets never travel in it."""

from __future__ import annotations

import argparse

import pytest

from stalwart.cli._etcd_flags import add_etcd_security_flags, refuse_without_rdzv, with_security
from stalwart.coordinator import EtcdSecurity, etcd_url, parse_etcd_url
from stalwart.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_etcd_security_flags(p)
    return p.parse_args(list(argv))


def test_flags_fold_into_the_url_and_parse_back() -> None:
    args = _args(
        "--rdzv-tls-ca", "/p/ca.pem", "--rdzv-tls-cert", "/p/c.pem", "--rdzv-tls-key",
        "/p/c.key", "--rdzv-user", "job7", "--rdzv-password-file", "/p/pw",
    )  # fmt: skip
    url = with_security("etcd://h1:2379,[::1]:2380/job7", args)
    assert url.startswith("etcds://")
    target = parse_etcd_url(url)
    assert target.endpoints == [("h1", 2379), ("::1", 2380)] and target.job_id == "job7"
    assert target.security == EtcdSecurity(
        tls=True, ca_file="/p/ca.pem", cert_file="/p/c.pem", key_file="/p/c.key",
        user="job7", password_file="/p/pw",
    )  # fmt: skip
    assert etcd_url(target) == url
    assert with_security("etcd://h/j", _args()) == "etcd://h/j"  # no flags: unchanged


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("etcds://h/j?password=hunter2", "visible to every user"),
        ("etcds://h/j?colour=red", "unknown option"),
        ("etcds://h/j?ca=a&ca=b", "given once"),
        ("etcds://h/j?user=u", "no password source"),
        ("etcds://h/j?cert=/c", "both cert= and key="),
        ("etcds://u:pw@h/j", "credentials in the URL"),
        ("http://h/j", "etcds://"),
    ],
)
def test_bad_security_options_are_one_line(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_etcd_url(url)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_flags_without_rdzv_or_against_the_url_are_refused() -> None:
    with pytest.raises(ConfigError, match="need --rdzv"):
        refuse_without_rdzv(_args("--rdzv-user", "u"))
    with pytest.raises(ConfigError, match="contradicts"):
        with_security("etcds://h/j?ca=/a", _args("--rdzv-tls-ca", "/b"))
