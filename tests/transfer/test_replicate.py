"""Background replication to a buddy: newest snapshot only, once per sequence number."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest

from stalwart.checkpoint.slots import latest_complete
from stalwart.contract.shm_names import slot_dir
from stalwart.transfer import SlotReceiver
from stalwart.transfer.replicate import BEHIND_GRACE_S, ReplicaConfig, Replicator

from .conftest import SHM, Spaces, read_slot, write_slot


@pytest.fixture
def second_rank(spaces: Spaces) -> Iterator[str]:
    d = slot_dir(SHM, f"{spaces.src}-r1")
    os.makedirs(d, mode=0o700)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(slot_dir(SHM, f"{spaces.dst}-r1"), ignore_errors=True)


def test_sends_each_new_snapshot_once(
    receiver: SlotReceiver, token: bytes, spaces: Spaces, second_rank: str
) -> None:
    sources = {spaces.dst: spaces.src_dir, f"{spaces.dst}-r1": second_rank}
    rep = Replicator(token, receiver.address, sources, ReplicaConfig(rate_bytes_per_s=None))
    assert rep.sync_once() == []  # nothing snapshotted yet
    write_slot(spaces.src_dir, 0, seq=1, data=b"a" * 5000, step=1)
    write_slot(second_rank, 0, seq=1, data=b"b" * 7000, step=1)
    assert sorted(r.nbytes for r in rep.sync_once()) == [5000, 7000]
    assert rep.sync_once() == []  # the buddy is up to date
    write_slot(spaces.src_dir, 1, seq=2, data=b"c" * 5000, step=2)
    write_slot(second_rank, 1, seq=2, data=b"d" * 7000, step=2)
    assert sorted((r.namespace, r.step) for r in rep.sync_once()) == [
        (spaces.dst, 2),
        (f"{spaces.dst}-r1", 2),
    ]
    found = latest_complete(spaces.dst_dir, 2)
    assert found is not None and read_slot(spaces.dst_dir, found[0])[1] == b"c" * 5000


def test_a_round_sends_one_step_that_every_rank_holds(
    receiver: SlotReceiver, token: bytes, spaces: Spaces, second_rank: str
) -> None:
    """Rank 0 is a snapshot ahead of rank 1: the round sends the step both hold, so the
    replicas of the node's ranks never drift apart (a lost node is restored to a step
    every one of its ranks holds)."""
    sources = {spaces.dst: spaces.src_dir, f"{spaces.dst}-r1": second_rank}
    rep = Replicator(token, receiver.address, sources, ReplicaConfig(rate_bytes_per_s=None))
    write_slot(spaces.src_dir, 0, seq=1, data=b"a" * 5000, step=50)
    write_slot(spaces.src_dir, 1, seq=2, data=b"c" * 5000, step=100)
    write_slot(second_rank, 0, seq=1, data=b"b" * 7000, step=50)
    assert rep.round_step() == 50
    assert sorted((r.namespace, r.step) for r in rep.sync_once()) == [
        (spaces.dst, 50),
        (f"{spaces.dst}-r1", 50),
    ]
    assert rep.sync_once() == []  # rank 1 has no step 100 yet: rank 0's waits for it
    write_slot(second_rank, 1, seq=2, data=b"d" * 7000, step=100)
    assert rep.round_step() == 100
    assert sorted(r.step for r in rep.sync_once()) == [100, 100]


def test_ranks_that_share_no_step_each_send_their_newest(
    receiver: SlotReceiver, token: bytes, spaces: Spaces, second_rank: str
) -> None:
    sources = {spaces.dst: spaces.src_dir, f"{spaces.dst}-r1": second_rank}
    rep = Replicator(token, receiver.address, sources, ReplicaConfig(rate_bytes_per_s=None))
    write_slot(spaces.src_dir, 0, seq=1, data=b"a" * 5000, step=7)
    write_slot(second_rank, 0, seq=1, data=b"b" * 7000, step=9)
    assert rep.round_step() is None
    assert sorted(r.step for r in rep.sync_once()) == [7, 9]


def test_background_thread_replicates_and_stops(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    rep = Replicator(
        token,
        lambda: receiver.address,
        {spaces.dst: spaces.src_dir},
        ReplicaConfig(rate_bytes_per_s=50e6, poll_s=0.05),
    )
    rep.start()
    try:
        write_slot(spaces.src_dir, 0, seq=1, data=os.urandom(100_000), step=5)
        (got,) = receiver.wait_results(1, timeout_s=30)
        assert got.ok and got.step == 5
    finally:
        rep.close()
    assert rep.stats.sent == {spaces.dst: 1}


def test_no_buddy_and_a_dead_buddy(token: bytes, spaces: Spaces) -> None:
    write_slot(spaces.src_dir, 0, seq=1, data=b"x" * 100)
    assert Replicator(token, lambda: None, {spaces.dst: spaces.src_dir}).sync_once() == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening
        rep = Replicator(token, s.getsockname(), {f"ns-{uuid.uuid4().hex[:6]}": spaces.src_dir})
        assert rep.sync_once() == [] and rep.stats.failures == 1
        assert "is the receiver running" in (rep.stats.last_error or "")


def test_close_cuts_a_capped_transfer_and_nothing_is_published(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    import time

    write_slot(spaces.src_dir, 0, seq=1, data=os.urandom(2_000_000))
    cfg = ReplicaConfig(rate_bytes_per_s=100_000, poll_s=0.05)  # 20 s for the whole slot
    rep = Replicator(token, receiver.address, {spaces.dst: spaces.src_dir}, cfg)
    rep.start()
    try:
        deadline = time.monotonic() + 30
        while not os.path.isdir(spaces.dst_dir):  # the receiver accepted the offer
            assert time.monotonic() < deadline, "the transfer never started"
            threading.Event().wait(0.01)
    finally:
        rep.close()
    (got,) = receiver.wait_results(1, timeout_s=30)
    assert not got.ok and rep.stats.sent == {} and rep.stats.failures == 0
    assert latest_complete(spaces.dst_dir, 2) is None


def test_a_replica_older_than_every_kept_snapshot_is_reported(
    receiver: SlotReceiver, token: bytes, spaces: Spaces
) -> None:
    """Rounds slower than the snapshot interval: the buddy's copy falls out of the two
    snapshots the rank keeps, where no recovery can use it. Said once, not every round."""
    told: list[str] = []
    rep = Replicator(
        token,
        receiver.address,
        {spaces.dst: spaces.src_dir},
        ReplicaConfig(rate_bytes_per_s=None),
        on_behind=told.append,
    )
    write_slot(spaces.src_dir, 0, seq=1, data=b"a" * 5000, step=50)
    rep.sync_once()
    assert rep.behind() is None
    write_slot(spaces.src_dir, 1, seq=2, data=b"b" * 5000, step=100)
    assert rep.behind() is None  # step 100 not sent yet, but 50 is still kept
    write_slot(spaces.src_dir, 0, seq=3, data=b"c" * 5000, step=150)
    why = rep.behind()
    assert why is not None and "step 50, older than every snapshot" in why
    assert "[100, 150]" in why and "--replica-rate" in why
    rep.check_behind(100.0)
    rep.check_behind(100.0 + BEHIND_GRACE_S / 2)
    assert told == []  # a moment behind (a slow round) is not worth a warning
    rep.check_behind(100.0 + BEHIND_GRACE_S)
    rep.check_behind(100.0 + 2 * BEHIND_GRACE_S)
    assert told == [why]  # once
    rep.sync_once()  # catches up: step 150 sent
    assert rep.behind() is None
    rep.check_behind(200.0)
    write_slot(spaces.src_dir, 1, seq=4, data=b"d" * 5000, step=200)
    write_slot(spaces.src_dir, 0, seq=5, data=b"e" * 5000, step=250)
    rep.check_behind(300.0)
    rep.check_behind(300.0 + BEHIND_GRACE_S)  # behind again for long: said again
    assert len(told) == 2
