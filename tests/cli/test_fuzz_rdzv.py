"""Fuzzing what `stalwart run` reads from its command line and files: the --rdzv-conf
loader and --rdzv-endpoint; nothing but ConfigError escapes."""

from __future__ import annotations

import json
import os
import tempfile

from hypothesis import event, given, settings
from hypothesis import strategies as st

from stalwart.agent.cluster._address import parse_endpoint
from stalwart.agent.cluster.etcd import rdzv_from_file
from stalwart.coordinator import parse_etcd_url
from stalwart.errors import ConfigError

_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.sampled_from(["h:2379", "[::1]:1", "[zz]:1", "h:²", "job7", "etcd://h:1/j"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["url", "endpoints", "job", "x"]), inner, max_size=4),
    ),
    max_leaves=12,
)
_VALID = st.builds(
    lambda eps, job: {"endpoints": eps, "job": job},
    st.lists(st.sampled_from(["h:2379", "[::1]:1", "10.0.0.5", "[zz]:1", "h:²"]), max_size=3),
    st.sampled_from(["job7", "a/b", ""]),
)
_FILES = st.one_of(
    _VALID.map(lambda doc: json.dumps(doc).encode()),
    _JSON.map(lambda doc: json.dumps(doc).encode()),
    st.integers(1, 30_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1, 30_000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    st.binary(max_size=64),
)


@settings(max_examples=300, deadline=None, database=None)
@given(_FILES)
def test_rdzv_conf_only_config_errors_escape(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rdzv.json")
        with open(path, "wb") as f:
            f.write(content)
        try:
            url = rdzv_from_file(path)
        except ConfigError as err:
            assert "\n" not in str(err)
            return
        parse_etcd_url(url)  # what it returns is a valid --rdzv
        event("parsed")


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.one_of(
        st.builds(
            lambda h, p: f"{h}:{p}",
            st.one_of(st.text(max_size=10), st.ip_addresses().map(str)),
            st.one_of(st.integers(-2, 70000).map(str), st.text(max_size=6)),
        ),
        st.text(max_size=30),
    )
)
def test_rdzv_endpoint_only_config_errors_escape(text: str) -> None:
    try:
        host, port = parse_endpoint(text)
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert host and 0 < port < 65536
