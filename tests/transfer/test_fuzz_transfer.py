"""Fuzzing the transfer protocol's decoders: offers, slot metas and chunk headers from an
authenticated peer, and raw bytes from an unauthenticated one. Only TransferErrors come
out, every rejection is recorded with a one-line reason (never an internal error), and
the receiver still takes a real transfer afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.transfer import (
    ReceiverConfig,
    SendConfig,
    SlotReceiver,
    TransferError,
    _wire,
    send_slot,
)

from .conftest import SHM, Spaces, write_slot

FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CHUNK = 4096
DATA = os.urandom(2 * CHUNK)
TOKEN = b"fuzz-token-" + b"0" * 32

numbers = st.one_of(
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, CHUNK, len(DATA), 2, 2**40]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=16))
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _offer(namespace: str, meta_len: int) -> dict[str, Any]:
    return {
        "type": "offer",
        "namespace": namespace,
        "data_size": len(DATA),
        "chunk_bytes": CHUNK,
        "chunks": 2,
        "meta_bytes": meta_len,
    }


def _fields(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with some fields replaced by anything, or dropped."""
    keys = sorted(base)
    return st.dictionaries(st.sampled_from(keys), json_values, max_size=len(keys)).map(
        lambda changed: {**base, **changed}
    ) | st.sets(st.sampled_from(keys)).map(lambda drop: {k: base[k] for k in keys if k not in drop})


@pytest.fixture(scope="module")
def rx() -> Iterator[SlotReceiver]:
    with SlotReceiver(TOKEN, ReceiverConfig(shm_dir=SHM, io_timeout_s=5.0)) as receiver:
        yield receiver


@pytest.fixture(scope="module")
def fuzz_spaces() -> Iterator[Spaces]:
    import shutil
    import uuid

    tag = uuid.uuid4().hex[:10]
    sp = Spaces(f"test-fsrc-{tag}", f"test-fdst-{tag}")
    os.makedirs(sp.src_dir, mode=0o700)
    yield sp
    for d in (sp.src_dir, sp.dst_dir):
        shutil.rmtree(d, ignore_errors=True)


def _session(rx: SlotReceiver, frames: list[bytes]) -> None:
    """Authenticate, send ``frames`` (MAC'd), read until the receiver answers or closes."""
    with socket.create_connection(rx.address, timeout=10) as s:
        ch = _wire.client_handshake(s, TOKEN)
        try:
            for body in frames:
                ch.send_raw(body)
            s.shutdown(socket.SHUT_WR)
            while True:
                ch.recv(("ready", "result"))
        except (TransferError, OSError):
            pass


def _check_recorded(rx: SlotReceiver, before: int) -> None:
    results = rx.wait_results(before + 1, timeout_s=30)
    for r in results[before:]:
        assert not (r.error or "").startswith("internal error"), r.error
        assert "\n" not in (r.error or "")


@FUZZ
@given(body=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_transfer_decode_raises_only_transfer_errors(body: bytes) -> None:
    try:
        obj = _wire.decode(body)
    except TransferError:
        return
    assert isinstance(obj, dict)
    for name, kind in (("namespace", str), ("data_size", int), ("i", int)):
        with contextlib.suppress(TransferError):
            _wire.field(obj, name, kind)


@FUZZ
@given(data=st.data())
def test_fuzzed_offers_and_metas_are_refused_cleanly(
    rx: SlotReceiver, fuzz_spaces: Spaces, data: st.DataObject
) -> None:
    meta = write_slot(fuzz_spaces.src_dir, 0, seq=1, data=DATA).encode()
    meta_doc = json.loads(meta)
    fuzz_meta = data.draw(
        st.one_of(
            st.just(meta),
            _fields(meta_doc).map(lambda d: json.dumps(d).encode()),
            st.binary(max_size=64),
        )
    )
    offer = data.draw(_fields(_offer(fuzz_spaces.dst, len(fuzz_meta))))
    before = len(rx.results())
    _session(rx, [json.dumps(offer).encode(), fuzz_meta])
    _check_recorded(rx, before)


@FUZZ
@given(header=_fields({"type": "chunk", "i": 0, "offset": 0, "length": CHUNK, "xxh3": "0" * 32}))
def test_fuzzed_chunk_headers_are_refused_cleanly(
    rx: SlotReceiver, fuzz_spaces: Spaces, header: dict[str, Any]
) -> None:
    meta = write_slot(fuzz_spaces.src_dir, 0, seq=1, data=DATA).encode()
    before = len(rx.results())
    frames = [json.dumps(_offer(fuzz_spaces.dst, len(meta))).encode(), meta]
    _session(rx, [*frames, json.dumps(header).encode()])
    _check_recorded(rx, before)


@FUZZ
@given(raw=st.binary(min_size=1, max_size=300))
def test_unauthenticated_bytes_cost_only_their_connection(rx: SlotReceiver, raw: bytes) -> None:
    with socket.create_connection(rx.address, timeout=10) as s:
        s.recv(4096)  # the hello
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
        except OSError as exc:
            assert not isinstance(exc, TimeoutError)


def test_the_receiver_still_takes_a_transfer(rx: SlotReceiver, fuzz_spaces: Spaces) -> None:
    write_slot(fuzz_spaces.src_dir, 0, seq=7, data=DATA)
    res = send_slot(
        rx.address, TOKEN, fuzz_spaces.src_dir, fuzz_spaces.dst, config=SendConfig(CHUNK)
    )
    assert res.seq == 7 and res.nbytes == len(DATA)
