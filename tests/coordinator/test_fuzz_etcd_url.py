"""Fuzzing the ``--rdzv`` URL parser: nothing but ConfigError escapes, and what parses is
a valid target (hosts are names or IPv6 literals, ports in 1..65535)."""

from __future__ import annotations

import ipaddress
import re

from hypothesis import event, given, settings
from hypothesis import strategies as st

from stalwart.coordinator import parse_etcd_url
from stalwart.errors import ConfigError

_HOSTS = st.one_of(
    st.sampled_from(["h", "10.0.0.5", "etcd-1.cluster", "[::1]", "[zz]", "[]", "[fe80::1%eth0]"]),
    st.text(alphabet="abz09.-[]:%é", max_size=12),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
)
_PORTS = st.one_of(
    st.just(""),
    st.integers(-3, 70000).map(lambda p: f":{p}"),
    st.sampled_from([":²", ":٣", ":", ":+1", ": 1", ":1e3", ":" + "9" * 30]),
)
_ENDPOINTS = st.builds(lambda h, p: h + p, _HOSTS, _PORTS)
_VALID = st.builds(
    lambda hosts, job: f"etcd://{','.join(hosts)}/{job}",
    st.lists(
        st.builds(
            lambda h, p: f"{h}:{p}",
            st.one_of(st.ip_addresses(v=6).map(lambda a: f"[{a}]"), st.just("etcd-0.local")),
            st.integers(0, 65536),
        ),
        min_size=1,
        max_size=3,
    ),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True),
)
_URLS = st.one_of(
    _VALID,
    st.builds(
        lambda scheme, eps, job: f"{scheme}://{','.join(eps)}/{job}",
        st.sampled_from(["etcd", "ETCD", "http", ""]),
        st.lists(_ENDPOINTS, max_size=4),
        st.one_of(st.sampled_from(["job7", "a/b", "", ".x", "j" * 129]), st.text(max_size=10)),
    ),
    st.text(max_size=60),
)
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", re.ASCII)


@settings(max_examples=400, deadline=None, database=None)
@given(_URLS)
def test_only_config_errors_escape(url: str) -> None:
    try:
        target = parse_etcd_url(url)
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert target.endpoints and target.job_id and "/" not in target.job_id
    for host, port in target.endpoints:
        assert 0 < port < 65536
        if not _NAME.fullmatch(host):
            ipaddress.IPv6Address(host)  # a bracketed host is a real IPv6 literal
    event("parsed")
