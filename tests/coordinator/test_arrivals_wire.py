"""The arrival relay's wire format (coordinator/arrivals.py): what a worker's line may
ask of its agent, bounded before use; anything else is refused, never raised."""

from __future__ import annotations

import json

import pytest

from stalwart.coordinator import Compare, Put
from stalwart.coordinator.arrivals import (
    Arrive,
    Await,
    encode_arrive,
    encode_await,
    parse_reply,
    parse_request,
)

ROOT = "/stalwart/j/"


def test_requests_round_trip() -> None:
    guard = (
        Compare(f"{ROOT}members/node3", "create_revision", "==", 17),
        Compare(f"{ROOT}gen", "value", "==", b"4"),
        Compare(f"{ROOT}agreed/000000000004.0", "mod_revision", "==", 0),
    )
    req = Arrive(guard, Put(f"{ROOT}rt/000000000004.0/000009", b'{"rank": 9}'), peers=8)
    line = encode_arrive(req)
    assert line is not None and line.endswith(b"\n")
    assert parse_request(line[:-1], ROOT) == req
    wait = Await(
        f"{ROOT}agreed/000000000004.", f"{ROOT}agreed/000000000004.0", f"{ROOT}agreed/e", 5
    )
    assert parse_request(encode_await(wait)[:-1], ROOT) == wait


def test_what_cannot_travel_is_not_encoded() -> None:
    """The worker then writes its arrival itself."""
    put = Put(f"{ROOT}rt/0/1", b"{}")
    assert encode_arrive(Arrive((Compare(f"{ROOT}gen", "value", "==", b"\xff"),), put)) is None
    assert encode_arrive(Arrive((), Put(f"{ROOT}rt/0/1", "é".encode()))) is None
    assert encode_arrive(Arrive((), Put(f"{ROOT}rt/0/1", b"{}", lease=7))) is None


def _arrive(**change: object) -> bytes:
    doc: dict[str, object] = {
        "v": 1,
        "op": "arrive",
        "key": f"{ROOT}rt/000000000001.0/000001",
        "value": "{}",
        "guard": [[f"{ROOT}gen", "value", "==", "1"]],
        "peers": 8,
    }
    doc.update(change)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"[]",
        b"{",
        b'"x"',
        _arrive(v=2),
        _arrive(op="delete"),
        _arrive(key="/stalwart/other/rt/1"),  # another job's
        _arrive(key=f"{ROOT}members/node0"),  # not an arrival
        _arrive(key=f"{ROOT}rt/" + "x" * 600),
        _arrive(value=3),
        _arrive(guard=[[f"{ROOT}gen", "value", "==", 1]]),  # a value compare's int operand
        _arrive(guard=[[f"{ROOT}gen", "lease", "==", 1]]),
        _arrive(guard=[[f"{ROOT}gen", "version", "<=", 1]]),
        _arrive(guard=[["/elsewhere", "version", "==", 1]]),
        _arrive(guard=[[f"{ROOT}gen", "version", "==", True]]),
        _arrive(guard=[[f"{ROOT}gen", "version", "==", -1]]),
        _arrive(guard=[[f"{ROOT}gen", "version", "==", 1 << 70]]),
        _arrive(guard=[[f"{ROOT}gen", "value", "==", "é"]]),
        _arrive(guard=[[f"{ROOT}gen", "version", "==", 1]] * 9),
        _arrive(guard=[[f"{ROOT}gen", "version", "=="]]),
        _arrive(peers=0),
        _arrive(peers=5000),
        _arrive(peers="8"),
        b'{"v": 1, "op": "await", "prefix": "/stalwart/j/rt/", "key": "/stalwart/j/rt/1", '
        b'"end": "/stalwart/j/agreed/e", "start": 1}',
        b'{"v": 1, "op": "await", "prefix": "/stalwart/j/agreed/1.", "key": "/stalwart/j/agreed/2",'
        b' "end": "/stalwart/j/agreed/e", "start": 1}',  # a key outside its prefix
        b'{"v": 1, "op": "await", "prefix": "/stalwart/j/agreed/1.", '
        b'"key": "/stalwart/j/agreed/1.0", "end": "/stalwart/j/agreed/e", "start": 0}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"v": 1, "op": "arrive", "value": "' + b"x" * (1 << 20) + b'"}',
    ],
)
def test_a_request_out_of_format_is_refused(line: bytes) -> None:
    assert parse_request(line, ROOT) is None


def test_replies() -> None:
    assert parse_reply(b'{"v":1,"ok":true,"rev":12}') is not None
    got = parse_reply(b'{"v":1,"ok":false,"rev":3}')
    assert got is not None and (got.ok, got.rev) == (False, 3)
    got = parse_reply(b'{"v":1,"record":"{\\"target\\": 4}"}')
    assert got is not None and got.record == b'{"target": 4}'
    assert parse_reply(b'{"v":1,"end":true}') is not None
    assert parse_reply(b'{"v":1,"broken":true}') is not None
    for bad in (
        b"",
        b"{}",
        b'{"v":2,"ok":true,"rev":1}',
        b'{"v":1,"ok":1,"rev":1}',
        b'{"v":1,"ok":true,"rev":-1}',
        b'{"v":1,"record":5}',
        b'{"v":1,"end":1}',
        b"[[[",
    ):
        assert parse_reply(bad) is None, bad
