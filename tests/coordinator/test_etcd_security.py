"""etcd as a real cluster runs it: TLS with client certificates and auth on
(docs/etcd.md, "TLS and authentication"; docs/security.md). Every refusal is one line
that names the fix, and the job token is never where a client without the job's
credentials can read it."""

from __future__ import annotations

import base64
import http.client
import json
import os
import time
from pathlib import Path

import pytest
from _load import scaled

from stalwart.agent.cluster.etcd import open_etcd
from stalwart.agent.config import LaunchConfig
from stalwart.coordinator import (
    AuthenticationError,
    EtcdStore,
    StoreUnavailableError,
    TokenFileError,
    create_token_file,
    token_check,
)
from stalwart.errors import ConfigError

from .conftest import etcd_config
from .etcd_secure import SecureEtcd, running_secure_etcd
from .etcd_server import running_etcd

pytestmark = pytest.mark.e2e


@pytest.fixture
def secure() -> SecureEtcd:  # type: ignore[misc]
    with running_secure_etcd() as s:
        yield s


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _raw_range(port: int, key: bytes, *, tls: SecureEtcd | None) -> tuple[int, bytes]:
    """A range request as an attacker makes it: no etcd user (and, with ``tls``, the
    CA to talk TLS and nothing else)."""
    body = json.dumps({"key": base64.b64encode(key).decode(), "range_end": "AA=="})
    if tls is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=10, context=tls.tls.client_context()
        )
    try:
        conn.request("POST", "/v3/kv/range", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_wrong_ca_is_refused_at_once_naming_the_flag(secure: SecureEtcd) -> None:
    store = EtcdStore.from_url(secure.url(ca=secure.other_ca), etcd_config())
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError) as err:
        store.ping()
    store.close()
    assert time.monotonic() - t0 < etcd_config().reconnect_timeout  # not retried to the end
    assert "--rdzv-tls-ca" in _one_line(err.value)


def test_no_credentials_is_refused_naming_the_user_flags(secure: SecureEtcd) -> None:
    with (
        EtcdStore.from_url(secure.url(user="", **{"password-file": ""}), etcd_config()) as st,
        pytest.raises(AuthenticationError) as err,
    ):
        st.get("x")
    assert "--rdzv-user" in _one_line(err.value)


def test_wrong_password_is_refused_naming_the_password_file(
    secure: SecureEtcd, tmp_path: Path
) -> None:
    bad = tmp_path / "pw"
    bad.write_text("not-the-password\n")
    bad.chmod(0o600)
    with (
        EtcdStore.from_url(secure.url(**{"password-file": str(bad)}), etcd_config()) as st,
        pytest.raises(AuthenticationError) as err,
    ):
        st.ping()
    assert "--rdzv-password-file" in _one_line(err.value)


def test_world_readable_password_file_is_refused(secure: SecureEtcd, tmp_path: Path) -> None:
    loose = tmp_path / "pw"
    loose.write_text("whatever\n")
    loose.chmod(0o644)
    with (
        EtcdStore.from_url(secure.url(**{"password-file": str(loose)}), etcd_config()) as st,
        pytest.raises(ConfigError) as err,
    ):
        st.ping()
    assert "chmod 600" in _one_line(err.value)


def test_plain_url_against_tls_port_names_etcds(secure: SecureEtcd) -> None:
    with (
        EtcdStore.from_url(f"etcd://127.0.0.1:{secure.port}/job7", etcd_config()) as st,
        pytest.raises(AuthenticationError) as err,
    ):
        st.ping()
    assert "etcds://" in _one_line(err.value)


def test_missing_client_cert_is_refused(secure: SecureEtcd) -> None:
    cfg = etcd_config(reconnect_timeout=1.0)
    with (
        EtcdStore.from_url(secure.url(cert="", key=""), cfg) as st,
        pytest.raises((AuthenticationError, StoreUnavailableError)) as err,
    ):
        st.ping()
    assert "--rdzv-tls-cert" in _one_line(err.value)


def test_the_job_user_reaches_only_its_own_prefix(secure: SecureEtcd) -> None:
    with (
        EtcdStore.from_url(secure.url("job8"), etcd_config()) as other,
        pytest.raises(AuthenticationError),
    ):
        other.ping()  # job7's credentials on job8's prefix


def test_token_in_secure_etcd_is_unreadable_without_credentials(secure: SecureEtcd) -> None:
    cfg = LaunchConfig(script=__file__, rdzv=secure.url(), job="job7")
    store, token = open_etcd(cfg)
    try:
        kv = store.get("/stalwart/job7/launch/token")
        assert kv is not None and kv.value == token  # the job's credentials read it
        status, body = _raw_range(secure.port, b"/stalwart/job7/", tls=secure)
        assert status == 403 and token not in body, body  # a stranger with a valid cert
    finally:
        store.close()


def test_open_etcd_refuses_to_store_the_token_where_anyone_reads_it(tmp_path: Path) -> None:
    with running_etcd() as plain:
        url = f"etcd://127.0.0.1:{plain.client_port}/job7"
        with pytest.raises(ConfigError) as err:
            open_etcd(LaunchConfig(script=__file__, rdzv=url, job="job7"))
        assert "--token-file" in _one_line(err.value)
        status, body = _raw_range(plain.client_port, b"/stalwart/", tls=None)
        assert status == 200 and b"kvs" not in body  # nothing was written


def test_token_file_keeps_the_token_out_of_etcd(tmp_path: Path) -> None:
    with running_etcd() as plain:
        url = f"etcd://127.0.0.1:{plain.client_port}/job7"
        path = str(tmp_path / "token")
        store, token = open_etcd(
            LaunchConfig(script=__file__, rdzv=url, job="job7", token_file=path)
        )
        store.close()
        assert os.stat(path).st_mode & 0o777 == 0o600
        # a second node with the same file joins; etcd never holds the token itself
        store, again = open_etcd(
            LaunchConfig(script=__file__, rdzv=url, job="job7", token_file=path)
        )
        store.close()
        assert again == token
        status, body = _raw_range(plain.client_port, b"/stalwart/", tls=None)
        assert status == 200
        values = [base64.b64decode(kv["value"]) for kv in json.loads(body)["kvs"]]
        assert token_check(token) in values
        assert not any(token in v for v in values), values
        # a node handed a different file is refused in one line
        other = str(tmp_path / "other")
        create_token_file(other)
        with pytest.raises(TokenFileError) as err:
            open_etcd(LaunchConfig(script=__file__, rdzv=url, job="job7", token_file=other))
        assert "same --token-file" in _one_line(err.value)


def test_expired_auth_token_is_renewed(secure: SecureEtcd) -> None:
    """etcd's simple tokens lapse after --auth-token-ttl idle: a token etcd calls invalid
    is fetched again, for unary calls and for a watch's stream."""
    with EtcdStore.from_url(secure.url(), etcd_config()) as st:
        st.put("a", b"1")
        st._http.auth._token = "expired-token.1"  # what etcd says of a lapsed token
        st.put("a", b"2")
        kv = st.get("a")
        assert kv is not None and kv.value == b"2"
        assert st._http.auth.current() not in ("", "expired-token.1")
        rev = st.put("a", b"3")
        with st.watch("a", start_revision=rev) as watch:
            st._http.auth._token = "expired-token.2"  # the stream opens with it
            deadline = time.monotonic() + scaled(30)
            events = []
            while not events and time.monotonic() < deadline:
                events = watch.get(timeout=1.0)
            assert [e.kv.value for e in events] == [b"3"]
