"""The bandwidth cap's pacing logic, tested in-process on a fake clock (no timing)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from stalwart.transfer import Pacer, SendConfig, SlotReceiver, TransferError, send_slot

from .conftest import Spaces, write_slot


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        assert dt > 0
        self.now += dt
        self.slept += dt


def test_token_bucket_holds_the_rate() -> None:
    t = _FakeTime()
    p = Pacer(1000.0, burst_s=0.1, clock=t.clock, sleep=t.sleep)  # burst 100 bytes
    for _ in range(50):
        p.take(100)
    # 5000 bytes at 1000 B/s, the first burst free: 4.9 s of waiting, no more, no less
    assert t.slept == pytest.approx(4.9)


def test_idle_time_refills_only_up_to_the_burst() -> None:
    t = _FakeTime()
    p = Pacer(1000.0, burst_s=0.1, clock=t.clock, sleep=t.sleep)
    t.now += 100.0  # a long pause does not bank 100 s of bandwidth
    p.take(100)
    assert t.slept == 0
    p.take(300)
    assert t.slept == pytest.approx(0.3)


def test_send_is_paced_in_pieces(receiver: SlotReceiver, token: bytes, spaces: Spaces) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    write_slot(spaces.src_dir, 0, seq=1, data=data)
    t = _FakeTime()
    takes: list[int] = []
    pacer = Pacer(256 * 1024, burst_s=0.25, clock=t.clock, sleep=t.sleep)  # 64 KiB burst
    original = pacer.take

    def take(n: int) -> None:
        takes.append(n)
        original(n)

    pacer.take = take  # type: ignore[method-assign]
    cfg = SendConfig(chunk_bytes=256 * 1024)
    send_slot(receiver.address, token, spaces.src_dir, spaces.dst, config=cfg, pacer=pacer)
    assert sum(takes) == len(data) and max(takes) == pacer.piece == 64 * 1024
    # 1 MiB at 256 KiB/s with a 64 KiB burst: the sender waited 3.75 s of (fake) time
    assert t.slept == pytest.approx((len(data) - 64 * 1024) / (256 * 1024))


@pytest.mark.parametrize("rate", [0, -5.0])
def test_bad_cap_is_refused(rate: Any) -> None:
    with pytest.raises(TransferError, match="bandwidth cap"):
        Pacer(rate)


def _mapped_bytes(directory: str) -> int:
    """Bytes of this process's address space mapped from files in ``directory``."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(directory + "/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total += end - start
    return total


def test_a_paced_transfer_maps_one_chunk_at_a_time_on_both_sides(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    """A process's exit unmaps before it closes its sockets: an agent that died holding
    a whole slot mapped would be seen dead later by its buddy. Sampled at every pacing
    wait: the sender holds at most two chunks (one in flight, one being hashed); the
    receiver unmaps a chunk once hashed, which a loaded machine may delay by a chunk or
    two, so it is held to half the slot (never the whole of it)."""
    chunk = 64 * 1024 + 4096  # not a multiple of the mapping granularity on the receiver
    data = bytes(range(256)) * (16 * chunk // 256)
    write_slot(spaces.src_dir, 0, seq=1, data=data)
    t = _FakeTime()
    seen: list[tuple[int, int]] = []

    def sleep(dt: float) -> None:
        seen.append((_mapped_bytes(spaces.src_dir), _mapped_bytes(spaces.dst_dir)))
        t.sleep(dt)

    pacer = Pacer(4 * chunk, burst_s=0.01, clock=t.clock, sleep=sleep)
    cfg = SendConfig(chunk_bytes=chunk)
    send_slot(receiver.address, token, spaces.src_dir, spaces.dst, config=cfg, pacer=pacer)
    (got,) = receiver.wait_results(1, timeout_s=10)
    assert got.ok
    assert len(seen) > 16
    assert max(src for src, _ in seen) <= 2 * chunk + 8192
    assert 0 < max(dst for _, dst in seen) <= len(data) // 2
    assert _mapped_bytes(spaces.dst_dir) == 0  # nothing left mapped once it ended
    with open(os.path.join(spaces.dst_dir, f"slot{got.slot}.data"), "rb") as f:
        assert f.read() == data
