"""The replica receiver under floods and hung senders: unauthenticated connections are
capped apart (oldest evicted), handshakes have a whole deadline, and a takeover never
waits on a sender that hung mid-transfer."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

from stalwart.checkpoint.format import checksum
from stalwart.checkpoint.slots import latest_complete
from stalwart.transfer import (
    ReceiverConfig,
    SendConfig,
    SlotReceiver,
    TransferError,
    _wire,
    send_slot,
)

from .conftest import SHM, Spaces, write_slot

CHUNK = 64 * 1024
DATA = os.urandom(2 * CHUNK)


def _wait(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_sender_gets_through_a_flood_of_idle_connections(token: bytes, spaces: Spaces) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    cfg = ReceiverConfig(shm_dir=SHM, max_unauthenticated=16, max_unauthenticated_per_peer=16)
    with SlotReceiver(token, cfg) as rx:
        idle = [socket.create_connection(rx.address, timeout=5) for _ in range(100)]
        try:
            assert _wait(lambda: rx.stats["evicted"] + rx.stats["refused"] >= 100 - 16, timeout=30)
            # from the flood's own address: refused while the flood's connections are
            # younger than min_age, then it evicts the oldest (the replicator retries too)
            sent: list[int] = []

            def send() -> bool:
                with contextlib.suppress(TransferError):
                    cfg = SendConfig(chunk_bytes=CHUNK)
                    sent.append(
                        send_slot(rx.address, token, spaces.src_dir, spaces.dst, config=cfg).nbytes
                    )
                return bool(sent)

            assert _wait(send, timeout=30)
            assert sent == [len(DATA)]
            assert _wait(lambda: threading.active_count() < 16 + 10, timeout=30)  # not 100
        finally:
            for s in idle:
                s.close()


def test_a_dribbled_handshake_is_cut_at_its_deadline(token: bytes) -> None:
    cfg = ReceiverConfig(shm_dir=SHM, handshake_timeout_s=0.5)
    with SlotReceiver(token, cfg) as rx, socket.create_connection(rx.address) as s:
        s.settimeout(30)
        s.recv(4096)  # the hello
        s.sendall((3000).to_bytes(4, "big"))
        ended = "open"
        try:
            while True:
                time.sleep(0.1)  # pacing of the attacker, not an assertion
                s.send(b"x")
                s.setblocking(False)
                try:
                    if s.recv(4096) == b"":
                        ended = "closed"
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
                    s.settimeout(30)
        except OSError:
            ended = "closed"
        assert ended == "closed"
        (got,) = rx.wait_results(1, timeout_s=10)
        assert not got.ok and "stalled" in (got.error or "")


def test_release_cuts_a_transfer_whose_sender_hung(token: bytes, spaces: Spaces) -> None:
    """The lost node stopped mid-chunk with its socket open: release() returns at once
    (a 300 s io timeout would otherwise hold the namespace lock), and the copy received
    before stays the newest complete slot."""
    meta = write_slot(spaces.src_dir, 0, seq=1, data=DATA)
    cfg = ReceiverConfig(shm_dir=SHM, io_timeout_s=300.0)
    with SlotReceiver(token, cfg) as rx:
        send_slot(rx.address, token, spaces.src_dir, spaces.dst, config=SendConfig(CHUNK))
        with socket.create_connection(rx.address, timeout=10) as s:
            ch = _wire.client_handshake(s, token)
            body = meta.encode()
            offer = {"type": "offer", "namespace": spaces.dst, "data_size": len(DATA)}
            ch.send({**offer, "chunk_bytes": CHUNK, "chunks": 2, "meta_bytes": len(body)})
            ch.send_raw(body)
            assert ch.recv("ready")["slot"] in (0, 1)
            head = {"type": "chunk", "i": 0, "offset": 0, "length": CHUNK}
            ch.send({**head, "xxh3": checksum(DATA[:CHUNK])})
            s.sendall(DATA[: CHUNK // 2])  # ... and hangs here
            released: list[str] = []
            t = threading.Thread(target=lambda: released.append(rx.release(spaces.dst)))
            t.start()
            t.join(60)
            assert released == [spaces.dst_dir]
            s.settimeout(30)
            try:  # cut by release: EOF or a reset, not a timeout
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        found = latest_complete(spaces.dst_dir, 2)
        assert found is not None and found[1].seq == 1
