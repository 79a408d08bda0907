"""Joiner and survivor meet through the store: request, transfer, restore."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from stalwart.coordinator import MemoryStore
from stalwart.transfer import ReceiveResult, TransferError
from stalwart.transfer.handoff import StateRequest, pending_requests, request_state, serve_requests

from .conftest import Spaces, read_slot, write_slot

PREFIX = "stalwart/job/gen3/state-request/"


def test_joiner_gets_the_survivors_slot_through_the_store(token: bytes, spaces: Spaces) -> None:
    data = bytes(range(256)) * 1000
    write_slot(spaces.src_dir, 0, seq=9, data=data, step=17)
    store = MemoryStore()
    got: dict[str, Any] = {}

    def joiner() -> None:
        try:
            got["result"] = request_state(store, PREFIX + "2", token, spaces.dst, timeout_s=30)
        except BaseException as err:  # surfaced below
            got["error"] = err

    t = threading.Thread(target=joiner)
    t.start()
    try:
        sent = serve_requests(store, PREFIX, token, spaces.src_dir, wait_s=30)
    finally:
        t.join(timeout=60)
    assert not t.is_alive() and "error" not in got
    result: ReceiveResult = got["result"]
    assert [s.step for s in sent] == [17] and result.ok and result.step == 17
    meta, received = read_slot(spaces.dst_dir, result.slot or 0)
    assert meta is not None and meta.seq == 9 and received == data
    assert store.range(PREFIX).kvs == []  # the request is gone


def test_malformed_requests_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    store.put(PREFIX + "0", b"not json")
    store.put(PREFIX + "1", b'{"v": 1, "host": "127.0.0.1", "port": 70000, "namespace": "x"}')
    good = StateRequest(PREFIX + "2", "127.0.0.1", 4000, "job-r2")
    store.put(good.key, good.encode())
    assert pending_requests(store, PREFIX) == [good]
    assert "port must be an integer" in caplog.text
    with pytest.raises(TransferError, match="malformed"):
        StateRequest.decode("k", b"[]")


def test_unserved_request_times_out_with_its_key(token: bytes, spaces: Spaces) -> None:
    store = MemoryStore()
    with pytest.raises(TimeoutError, match="state-request/5"):
        request_state(store, PREFIX + "5", token, spaces.dst, timeout_s=0.2)
    assert store.range(PREFIX).kvs == []
