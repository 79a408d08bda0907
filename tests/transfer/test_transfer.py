"""Snapshot transfer: bit-for-bit copies, rejection of bad peers, nothing torn visible."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import pytest

from stalwart.checkpoint.format import checksum
from stalwart.checkpoint.slots import SlotFiles, latest_complete
from stalwart.coordinator import wire
from stalwart.transfer import (
    ChunkMismatchError,
    Pacer,
    SendConfig,
    SlotReceiver,
    SourceChangedError,
    TransferAuthError,
    TransferError,
    TransferProtocolError,
    _wire,
    send_slot,
    sender,
)

from .conftest import Spaces, read_slot, write_slot

CHUNK = 64 * 1024
DATA = os.urandom(3 * CHUNK + 1234)  # 4 chunks, the last one short


def _send(receiver: SlotReceiver, token: bytes, sp: Spaces, **kw: Any) -> Any:
    cfg = SendConfig(chunk_bytes=CHUNK)
    return send_slot(receiver.address, token, sp.src_dir, sp.dst, config=cfg, **kw)


def test_received_slot_equals_the_source_bit_for_bit(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    meta = write_slot(spaces.src_dir, 0, seq=5, data=DATA, step=40)
    write_slot(spaces.src_dir, 1, seq=4, data=b"older" * 10, step=39)  # not the newest
    res = _send(receiver, token, spaces)
    assert (res.step, res.seq, res.nbytes, res.chunks) == (40, 5, len(DATA), 4)
    (got,) = receiver.wait_results(1, timeout_s=10)
    assert got.ok and got.slot == res.slot and got.namespace == spaces.dst
    rmeta, rdata = read_slot(spaces.dst_dir, res.slot)
    assert rmeta is not None and rmeta.encode() == meta.encode()
    assert checksum(rdata) == checksum(DATA)
    # the next transfer goes to the other slot: the first copy stays complete meanwhile
    meta2 = write_slot(spaces.src_dir, 1, seq=6, data=DATA[::-1], step=41)
    res2 = _send(receiver, token, spaces)
    assert res2.slot != res.slot
    found = latest_complete(spaces.dst_dir, 2)
    assert found is not None and found[1].encode() == meta2.encode()
    assert read_slot(spaces.dst_dir, res.slot)[0] is not None


def test_snapshotter_restores_a_received_state(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    import torch

    from stalwart.checkpoint import SnapshotConfig, Snapshotter

    torch.manual_seed(0)
    first = torch.nn.Linear(64, 300)
    model = torch.nn.Sequential(first, torch.nn.Linear(300, 7))
    src = Snapshotter(SnapshotConfig(namespace=spaces.src))
    dst = Snapshotter(SnapshotConfig(namespace=spaces.dst))
    try:
        src.snapshot({"model": model, "step_count": 12}, step=12)
        pinned = src.pin_latest()  # a survivor sends step 12 while it keeps training
        assert pinned is not None
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        for step in (13, 14):
            with torch.no_grad():
                first.weight.add_(1.0)
            src.snapshot({"model": model, "step_count": step}, step=step)
        res = _send(receiver, token, spaces, slot=pinned[0])
        src.unpin(pinned[0])
        copy = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7))
        state: dict[str, Any] = {"model": copy, "step_count": 0}
        assert dst.restore(state) == 12 and res.step == 12
        for a, b in zip(expected.values(), copy.state_dict().values(), strict=True):
            assert checksum(a.numpy().tobytes()) == checksum(b.numpy().tobytes())
    finally:
        src.close()
        dst.close()


def test_corrupted_chunk_is_named_and_nothing_becomes_visible(
    receiver: SlotReceiver, token: bytes, spaces: Spaces, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    first = _send(receiver, token, spaces)
    write_slot(spaces.src_dir, 1, seq=2, data=DATA[::-1])

    def flip(sock: socket.socket, src: Any, offset: int, n: int, pacer: Any) -> None:
        with src.view(offset, n) as chunk:
            data = bytearray(chunk)
        if offset == 2 * CHUNK:  # damage chunk 2 on the wire
            data[100] ^= 0xFF
        sock.sendall(data)

    monkeypatch.setattr(sender, "_send_range", flip)
    with pytest.raises(ChunkMismatchError, match=r"chunk 2 \(bytes 131072\.\.196608\)") as info:
        _send(receiver, token, spaces)
    assert info.value.chunks == [2]
    results = receiver.wait_results(2, timeout_s=10)
    assert not results[1].ok and results[1].bad_chunks == (2,)
    # the slot written into has no meta; the previous copy is still the newest complete
    assert read_slot(spaces.dst_dir, 1 - first.slot)[0] is None
    found = latest_complete(spaces.dst_dir, 2)
    assert found is not None and found[1].seq == 1


def test_wrong_token_is_rejected_both_ways(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    with pytest.raises(TransferAuthError, match="refused our job token"):
        send_slot(receiver.address, b"x" * 64, spaces.src_dir, spaces.dst)
    (got,) = receiver.wait_results(1, timeout_s=10)
    assert not got.ok and "job token" in (got.error or "")
    assert not os.path.exists(spaces.dst_dir)
    # a receiver that does not hold the token is not trusted by the sender either
    with SlotReceiver(b"y" * 64) as impostor, pytest.raises(TransferAuthError):
        send_slot(impostor.address, token, spaces.src_dir, spaces.dst)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n",  # length field of 1.2 GB: refused before reading it
        b"\x00\x00\x00\x30" + bytes(48),  # a frame of the right size with a zero MAC
        b"\x00\x00\x00\x05hi",  # shorter than a MAC, then silence: closed below
    ],
)
def test_malformed_peer_is_rejected(receiver: SlotReceiver, garbage: bytes) -> None:
    with socket.create_connection(receiver.address, timeout=10) as s:
        s.recv(4096)  # the hello
        s.sendall(garbage)
        with contextlib.suppress(OSError):  # the receiver may have hung up already
            s.shutdown(socket.SHUT_WR)
        (got,) = receiver.wait_results(1, timeout_s=10)
    assert not got.ok and got.error
    assert "\n" not in got.error


def test_bad_offer_is_refused_with_a_reason(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    with pytest.raises(TransferProtocolError, match=r"namespace '\.\./evil'"):
        send_slot(receiver.address, token, spaces.src_dir, "../evil")
    assert not receiver.wait_results(1, timeout_s=10)[0].ok


def test_cut_transfer_publishes_nothing(token: bytes, spaces: Spaces) -> None:
    """An authenticated sender stops half-way through a chunk and the receiver shuts
    down: the slot it was writing into stays invisible."""
    meta = write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    from stalwart.transfer import ReceiverConfig

    receiver = SlotReceiver(token, ReceiverConfig(io_timeout_s=30))
    receiver.start()
    try:
        with socket.create_connection(receiver.address, timeout=10) as s:
            ch = _wire.client_handshake(s, token)
            body = meta.encode()
            ch.send(
                {
                    "type": "offer",
                    "namespace": spaces.dst,
                    "data_size": len(DATA),
                    "chunk_bytes": CHUNK,
                    "chunks": 4,
                    "meta_bytes": len(body),
                }
            )
            ch.send_raw(body)
            assert ch.recv("ready")["slot"] in (0, 1)
            ch.send(
                {
                    "type": "chunk",
                    "i": 0,
                    "offset": 0,
                    "length": CHUNK,
                    "xxh3": checksum(DATA[:CHUNK]),
                }
            )
            s.sendall(DATA[: CHUNK // 2])
            receiver.close()
            (got,) = receiver.results()
    finally:
        receiver.close()
    assert not got.ok
    assert latest_complete(spaces.dst_dir, 2) is None


def test_source_overwritten_mid_transfer_aborts(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    clock = [0.0]

    def sleep(dt: float) -> None:  # a snapshot starts overwriting the slot meanwhile
        clock[0] += dt
        os.unlink(os.path.join(spaces.src_dir, "slot0.json"))
        write_slot(spaces.src_dir, 0, seq=3, data=DATA)

    pacer = Pacer(len(DATA) / 2, burst_s=0.01, clock=lambda: clock[0], sleep=sleep)
    with pytest.raises(SourceChangedError, match="overwritten while being sent"):
        _send(receiver, token, spaces, pacer=pacer)
    (got,) = receiver.wait_results(1, timeout_s=10)
    assert not got.ok and "sender aborted" in (got.error or "")
    assert latest_complete(spaces.dst_dir, 2) is None


def test_unreachable_receiver_is_a_clear_error(token: bytes, spaces: Spaces) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        with pytest.raises(Exception, match="is the receiver running"):
            send_slot(("127.0.0.1", port), token, spaces.src_dir, spaces.dst)


def test_frames_are_the_coordinator_framing() -> None:
    # one framing for the project: length | MAC | JSON body (docs/wire-protocol.md)
    assert wire.MAC_SIZE == 32 and _wire.PROTOCOL == "stalwart-transfer"


def test_snapshots_taken_during_a_transfer_skip_the_pinned_slot(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    """The agent's case: the sender (another process in production) pins the newest slot
    with a pin file; snapshots taken meanwhile all go into the other slot."""
    import torch

    from stalwart.checkpoint import SnapshotConfig, Snapshotter

    state = {"w": torch.zeros(100_000)}
    snaps = Snapshotter(SnapshotConfig(namespace=spaces.src))
    clock = [0.0]

    def sleep(dt: float) -> None:  # training goes on while the capped transfer waits
        clock[0] += dt
        state["w"] += 1
        snaps.snapshot(state, step=int(state["w"][0]) + 1)

    try:
        snaps.snapshot(state, step=1)
        state["w"] += 1
        snaps.snapshot(state, step=2)
        pacer = Pacer(100_000.0, clock=lambda: clock[0], sleep=sleep)
        res = _send(receiver, token, spaces, pacer=pacer)
        assert res.step == 2 and clock[0] > 0  # several snapshots ran; step 2 arrived intact
        assert snaps.steps()[-1] > 3
        assert not [n for n in os.listdir(spaces.src_dir) if ".pin-" in n]  # unpinned
        out = {"w": torch.empty(100_000)}
        Snapshotter(SnapshotConfig(namespace=spaces.dst)).restore(out)
        assert torch.equal(out["w"], torch.ones(100_000))
    finally:
        snaps.close()


@pytest.mark.process  # a process that ends (tests/_tiers.py)
def test_pins_of_dead_processes_are_ignored(spaces: Spaces) -> None:
    import subprocess
    import sys

    from stalwart.checkpoint.slots import pin_slot, pinned_slots, unpin_slot

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    open(os.path.join(spaces.src_dir, f"slot1.pin-{dead.pid}-abcd"), "w").close()
    mine = pin_slot(spaces.src_dir, 0)
    assert pinned_slots(spaces.src_dir) == {0}
    assert [n for n in os.listdir(spaces.src_dir) if ".pin-" in n] == [os.path.basename(mine)]
    unpin_slot(mine)
    assert pinned_slots(spaces.src_dir) == set()


def test_receiver_never_overwrites_a_pinned_copy(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    from stalwart.checkpoint.slots import pin_slot, unpin_slot

    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    first = _send(receiver, token, spaces)
    second = _send(receiver, token, spaces)
    assert {first.slot, second.slot} == {0, 1}
    pins = [pin_slot(spaces.dst_dir, i) for i in (0, 1)]  # e.g. persists of both copies
    with pytest.raises(TransferProtocolError, match="pinned by a reader"):
        _send(receiver, token, spaces)
    unpin_slot(pins[first.slot])
    assert _send(receiver, token, spaces).slot == first.slot
    unpin_slot(pins[second.slot])


def test_joiner_state_equals_the_survivors_bit_for_bit(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    """Issue 4's join at the state level: model, optimizer (with its moments), loader and
    RNG state of a survivor, received from memory and restored into fresh objects."""
    import torch
    from torch.utils.data import TensorDataset

    from stalwart.checkpoint import RNGState, SnapshotConfig, Snapshotter
    from stalwart.data import loader

    def build(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ld = loader(TensorDataset(torch.randn(50, 16)), batch_size=4, world_size=2, rank=0)
        return {"model": model, "optimizer": opt, "loader": ld, "rng": RNGState()}

    survivor = build(0)
    for _ in range(3):
        (x,) = next(survivor["loader"])
        survivor["model"](x).square().mean().backward()
        survivor["optimizer"].step()
    src = Snapshotter(SnapshotConfig(namespace=spaces.src))
    dst = Snapshotter(SnapshotConfig(namespace=spaces.dst))
    try:
        src.snapshot(survivor, step=3)
        _send(receiver, token, spaces)
        joiner = build(1)  # other initial weights, empty optimizer state
        (x,) = next(joiner["loader"])
        joiner["model"](x).sum().backward()
        joiner["optimizer"].step()  # creates the moment tensors the state will fill
        assert dst.restore(joiner) == 3

        def digests(state: dict[str, Any]) -> list[str]:
            out = [checksum(t.numpy().tobytes()) for t in state["model"].state_dict().values()]
            for st in state["optimizer"].state.values():
                out += [checksum(v.numpy().tobytes()) for v in st.values()]
            return out

        assert digests(joiner) == digests(survivor)
        assert joiner["loader"].state_dict() == survivor["loader"].state_dict()
    finally:
        src.close()
        dst.close()


def test_prepare_faults_in_free_slots_and_keeps_complete_ones(
    token: bytes, spaces: Spaces, receiver: SlotReceiver
) -> None:
    data = bytes(range(256)) * 64
    write_slot(spaces.src_dir, 0, seq=3, data=data, step=5)
    first = send_slot(receiver.address, token, spaces.src_dir, spaces.dst)
    receiver.prepare(spaces.dst, len(data))
    other = SlotFiles(spaces.dst_dir, 1 - first.slot)
    assert os.path.getsize(other.data_path) == len(data)  # allocated before it is needed
    meta, received = read_slot(spaces.dst_dir, first.slot)
    assert meta is not None and meta.step == 5 and received == data  # untouched
    receiver.prepare(spaces.dst, 16)  # smaller: never shrinks a file
    assert read_slot(spaces.dst_dir, first.slot)[1] == data
    with pytest.raises(TransferError, match="max_bytes"):
        receiver.prepare(spaces.dst, 1 << 40)
