"""EtcdStore without a server: URL parsing, configuration checks, error mapping,
and the error for an unreachable etcd."""

from __future__ import annotations

import time

import pytest

from stalwart.coordinator import CompactedError, LeaseNotFoundError, StoreUnavailableError
from stalwart.coordinator._etcd_wire import EtcdApiError, error_from_body
from stalwart.coordinator.etcd import EtcdStore, EtcdStoreConfig, parse_etcd_url
from stalwart.errors import ConfigError

from .conftest import etcd_config
from .etcd_server import free_port


def test_parse_url() -> None:
    target = parse_etcd_url("etcd://10.0.0.5:2380/job7")
    assert (target.endpoints, target.job_id, target.namespace) == (
        [("10.0.0.5", 2380)],
        "job7",
        "/stalwart/job7/",
    )
    many = parse_etcd_url("etcd://h1,h2:12379,[::1]:3379/run-2.b/")
    assert many.endpoints == [("h1", 2379), ("h2", 12379), ("::1", 3379)]
    assert many.job_id == "run-2.b"
    store = EtcdStore.from_url("etcd://127.0.0.1:1/j")
    assert (store.job_id, store.namespace) == ("j", "/stalwart/j/")
    store.close()


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://h:2379/job", "scheme must be etcd://"),
        ("etcd://h:2379", "no job id"),
        ("etcd://h:2379/", "no job id"),
        ("etcd:///job", "no etcd host"),
        ("etcd://h:99999/job", "port '99999'"),
        ("etcd://h:x/job", "port 'x'"),
        ("etcd://h/a/b", "job id 'a/b'"),
        ("etcd://u:p@h/job", "credentials"),
        ("etcd://h_1/job", "no valid host"),
    ],
)
def test_bad_url_is_one_clear_line(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_etcd_url(url)
    message = str(err.value)
    assert needle in message and "etcd://host:2379/job-id" in message and "\n" not in message


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="reconnect_timeout"):
        EtcdStoreConfig(reconnect_timeout=0)
    with pytest.raises(ConfigError, match="marker_ttl"):
        EtcdStoreConfig(reconnect_timeout=200, marker_ttl=300)


def test_unreachable_server_names_address_and_deadline() -> None:
    port = free_port()
    store = EtcdStore([("127.0.0.1", port)], "/t/", etcd_config(reconnect_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        store.put("k", b"v")
    assert 0.5 <= time.monotonic() - started < 3.0
    assert f"127.0.0.1:{port} unreachable for 0.5s" in str(err.value)
    store.close()


def test_gateway_errors_map_to_store_errors() -> None:
    unary = {"error": "etcdserver: requested lease not found", "code": 5}
    assert isinstance(error_from_body(unary, "put"), LeaseNotFoundError)
    stream = {"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}}
    err = error_from_body(stream, "keepalive")
    assert isinstance(err, EtcdApiError) and err.retryable and "no leader" in str(err)
    compacted = {"message": "etcdserver: mvcc: required revision has been compacted", "code": 11}
    assert isinstance(error_from_body(compacted, "watch"), CompactedError)
