"""The peer tier reads a same-host peer's slots however many it keeps.

A DDP job with replica digest checks (``--sdc-every`` > 0) keeps three snapshot slots
per rank (the verified one stays pinned, runtime/integrity/_checks.py). After a node loss the
adopted ranks restore the agreed step from a survivor's slots; when that step sat in
the survivor's third slot, a reader that assumed two found "no complete snapshot of
step N" and the adopted ranks crashed until their rank was blocklisted (the 2-node
demo's node loss with the check on)."""

from __future__ import annotations

import shutil
import socket
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.checkpoint.slots import slot_count
from stalwart.contract.shm_names import SlotNames, slot_dir
from stalwart.runtime.rejoin._fixed import restore_agreed
from stalwart.runtime.rejoin._rendezvous import Agreement
from stalwart.runtime.state._memory_tier import peer_slots, read_slots

SHM = "/dev/shm"


@pytest.fixture
def names() -> Iterator[SlotNames]:
    job = f"test-peer-{uuid.uuid4().hex[:8]}"
    yield SlotNames(job, shm_dir=SHM)
    for rank in (0, 2):
        shutil.rmtree(slot_dir(SHM, f"{job}-r{rank}"), ignore_errors=True)


def _survivor(names: SlotNames) -> Snapshotter:
    """Rank 0 with the digest checks' three slots: steps 10, 20, 30 in slots 0, 1, 2
    (an empty slot is chosen first), step 10 pinned as the verified one."""
    snap = Snapshotter(SnapshotConfig(names.rank(0), slots=3, shm_dir=SHM))
    for step in (10, 20, 30):
        snap.snapshot({"w": torch.full((256,), float(step))}, step=step)
        snap.wait()
    return snap


def test_the_agreed_step_in_a_peers_third_slot_is_restored(names: SlotNames) -> None:
    survivor = _survivor(names)
    assert slot_count(survivor.directory) == 3
    own = Snapshotter(SnapshotConfig(names.rank(2), slots=3, shm_dir=SHM))  # adopted: empty
    state: dict[str, Any] = {"w": torch.zeros(256)}
    tracked: Any = SimpleNamespace(snapshots=own, state=state, preload=None, part=None, names=names)
    infos = (
        {"rank": 0, "steps": [10, 20, 30], "host": socket.gethostname()},
        {"rank": 2, "steps": [], "host": socket.gethostname()},
    )
    nbytes, tier, _ = restore_agreed(
        tracked, Agreement(3, 30, "peer", 30, infos), 2, use_memory=True
    )
    assert tier == "peer" and nbytes > 0
    assert torch.equal(state["w"], torch.full((256,), 30.0))
    # the elastic rejoin's path to the same slots
    peer = peer_slots(names, 30, [(0, infos[0])])
    assert peer is not None and peer.steps() == [10, 20, 30]
    own.close(unlink=True)
    survivor.close(unlink=True)


def test_a_peer_with_two_slots_is_read_with_two(names: SlotNames) -> None:
    snap = Snapshotter(SnapshotConfig(names.rank(0), shm_dir=SHM))
    for step in (1, 2):
        snap.snapshot({"w": torch.full((8,), float(step))}, step=step)
        snap.wait()
    reader = read_slots(names, 0)
    assert reader.config.slots == 2 and reader.steps() == [1, 2]
    snap.close(unlink=True)
    # a peer whose slots are gone (or never made): read as two empty slots
    assert read_slots(names, 0).steps() == []
