"""Fuzzing the store protocol's decoders: nothing but the documented error classes
escapes, no request is an internal error, and a live server keeps serving."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.coordinator import ProtocolError, StoreClient, StoreError, StoreServer, wire
from stalwart.coordinator._ops import HANDLERS
from stalwart.coordinator.server import StoreServerConfig

from .conftest import TOKEN, client_config
from .test_server import RawConn

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
DOCUMENTED = {
    "bad_request",
    "bad_frame",
    "too_large",
    "lease_not_found",
    "compacted",
    "shutting_down",
}

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**63, 1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ("key", "value", "lease", "prefix", "ttl", "timeout", "start_revision", "compare")
field_names = st.sampled_from((*FIELDS, "success", "failure", "op", "target", "operand"))
args = st.dictionaries(st.one_of(field_names, st.text(max_size=6)), json_values, max_size=6)
requests = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(sorted(HANDLERS)), st.text(max_size=8)), "args": args},
    optional={"rid": st.one_of(st.text(max_size=8), numbers)},
)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity included, as an attacker sends them


@pytest.fixture(scope="module")
def server() -> Iterator[StoreServer]:
    with StoreServer(TOKEN, StoreServerConfig(max_watch_wait=0.01)) as srv:
        yield srv


@FUZZ
@given(body=st.one_of(st.binary(max_size=200), json_values.map(_dumps)))
def test_decode_raises_only_protocol_error(body: bytes) -> None:
    try:
        obj = wire.decode(body)
    except ProtocolError:
        return
    assert isinstance(obj, dict)


@FUZZ
@given(obj=json_values)
def test_reply_decoders_raise_only_store_errors(obj: Any) -> None:
    for decoder in (
        wire.kv_from_json,
        wire.event_from_json,
        wire.compare_from_json,
        wire.op_from_json,
    ):
        with contextlib.suppress(StoreError):
            decoder(obj)
    assert isinstance(wire.error_from_reply(obj), StoreError)


@FUZZ
@given(request=requests)
def test_every_request_gets_a_documented_reply(server: StoreServer, request: Any) -> None:
    reply = server._handle(_dumps(request), ("fuzz", 0))
    assert isinstance(reply, dict)
    if reply["ok"] is not True:
        assert reply["error"]["code"] in DOCUMENTED, reply
    json.dumps(reply, allow_nan=False)  # the reply itself is valid wire JSON


@FUZZ
@given(request=requests)
def test_live_server_answers_fuzzed_frames_and_keeps_serving(
    server: StoreServer, request: Any
) -> None:
    raw = RawConn(server.port)
    try:
        raw.handshake()
        raw.send_body(_dumps(request))
        reply = raw.reply()
        assert reply["ok"] is True or reply["error"]["code"] in DOCUMENTED
    finally:
        raw.close()


@FUZZ
@given(data=st.binary(min_size=1, max_size=300))
def test_preauth_garbage_costs_only_its_connection(server: StoreServer, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        wire.recv_frame(sock, 4096)
        sock.settimeout(10)
        try:  # the server answers (an error) or closes; it never hangs on it
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):
                pass
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:
            assert not isinstance(exc, TimeoutError)


def test_the_server_still_serves_after_the_fuzzing(server: StoreServer) -> None:
    with StoreClient("127.0.0.1", server.port, TOKEN, client_config()) as client:
        assert client.ping() >= 0
        client.put("after", b"fuzz")
        assert client.get("after") is not None
    assert server.stats["rejected"] >= 0
