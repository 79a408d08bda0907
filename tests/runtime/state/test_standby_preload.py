"""A parked standby preloads its rank's replica (runtime/state/_standby.py): it copies each new
complete replica into its state, discards a copy that a writer overtook, and a restore
of the step it holds copies nothing."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.checkpoint import snapshot as snapshot_module
from stalwart.checkpoint.slots import SlotFiles
from stalwart.contract.shm_names import SlotNames, slot_dir
from stalwart.errors import CheckpointNotFoundError
from stalwart.runtime.rejoin._fixed import restore_agreed
from stalwart.runtime.rejoin._rendezvous import Agreement, no_common_point
from stalwart.runtime.state._standby import Preload

SHM = "/dev/shm"


@pytest.fixture
def job() -> Iterator[str]:
    name = f"test-preload-{uuid.uuid4().hex[:8]}"
    yield name
    for ns in (f"{name}-replica-r1", f"{name}-r1"):
        shutil.rmtree(slot_dir(SHM, ns), ignore_errors=True)


def _replica(job: str) -> Snapshotter:
    """The slots a buddy's receiver fills for rank 1 (same layout as a Snapshotter's)."""
    return Snapshotter(SnapshotConfig(f"{job}-replica-r1", shm_dir=SHM))


def _snapshot(snap: Snapshotter, value: float, step: int) -> None:
    snap.snapshot({"w": torch.full((1000,), value)}, step=step)
    snap.wait()


def test_poll_copies_each_new_replica_and_knows_what_it_holds(job: str) -> None:
    replica = _replica(job)
    state: dict[str, Any] = {"w": torch.zeros(1000)}
    pre = Preload(SlotNames(job, shm_dir=SHM), 1)
    pre.poll(state)  # nothing replicated yet: the state stays the initial one
    assert (pre.seq, pre.touched) == (None, False) and state["w"].sum() == 0
    _snapshot(replica, 1.0, step=5)
    pre.poll(state)
    assert torch.equal(state["w"], torch.full((1000,), 1.0))
    assert pre.step == 5 and pre.touched
    assert pre.holds(replica.directory, 5) and not pre.holds(replica.directory, 6)
    _snapshot(replica, 2.0, step=6)
    assert not pre.holds(replica.directory, 6)
    pre.poll(state)
    assert torch.equal(state["w"], torch.full((1000,), 2.0)) and pre.step == 6
    assert pre.holds(replica.directory, 6)
    replica.close(unlink=True)


def test_a_copy_overtaken_by_a_writer_is_discarded(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = _replica(job)
    _snapshot(replica, 1.0, step=5)
    # on one host the rank's own slots (the live rank's) may hold the same seq
    live = Snapshotter(SnapshotConfig(f"{job}-r1", shm_dir=SHM))
    _snapshot(live, 9.0, step=5)
    assert live.latest() is not None and replica.latest() is not None
    assert live.latest().seq == replica.latest().seq  # type: ignore[union-attr]
    original = snapshot_module.load_slot

    def overtaken(slot: SlotFiles, meta: Any, state: Any) -> None:
        original(slot, meta, state)
        slot.invalidate()  # a writer chose this slot meanwhile (before the pin)

    monkeypatch.setattr(snapshot_module, "load_slot", overtaken)
    pre = Preload(SlotNames(job, shm_dir=SHM), 1)
    pre.poll({"w": torch.zeros(1000)})
    assert pre.seq is None and pre.step is None and pre.touched
    assert not pre.holds(replica.directory, 5)
    replica.close(unlink=True)
    live.close(unlink=True)


def test_restore_of_the_preloaded_step_copies_nothing(job: str) -> None:
    replica = _replica(job)
    _snapshot(replica, 3.0, step=7)
    state: dict[str, Any] = {"w": torch.zeros(1000)}
    pre = Preload(SlotNames(job, shm_dir=SHM), 1)
    pre.poll(state)
    replica.close()
    # the adopter takes the replica over as rank 1's own slots (agent/cluster/_replica.py)
    shutil.move(slot_dir(SHM, f"{job}-replica-r1"), slot_dir(SHM, f"{job}-r1"))
    own = Snapshotter(SnapshotConfig(f"{job}-r1", shm_dir=SHM))
    with open(f"{own.directory}/replica.json", "w") as f:
        f.write("{}")
    state["w"].fill_(-1.0)  # were anything copied, this would be overwritten
    tracked: Any = SimpleNamespace(
        snapshots=own, state=state, preload=pre, part=None, names=SlotNames(job, shm_dir=SHM)
    )
    a = Agreement(1, 7, "memory", 9, ({"rank": 1, "steps": [7]},))
    nbytes, tier, preloaded = restore_agreed(tracked, a, 1, use_memory=True)
    assert (tier, preloaded) == ("replica", True) and nbytes > 0
    assert state["w"].sum() == -1000.0
    # another step is copied as usual
    pre.step = 6
    with open(f"{own.directory}/replica.json", "w") as f:
        f.write("{}")
    nbytes, tier, preloaded = restore_agreed(tracked, a, 1, use_memory=True)
    assert (tier, preloaded) == ("replica", False) and torch.equal(
        state["w"], torch.full((1000,), 3.0)
    )
    own.close(unlink=True)


def test_a_preloaded_standby_cannot_join_a_fresh_start() -> None:
    infos = ({"rank": 3, "steps": [150, 200]}, {"rank": 0, "steps": [250], "disk": [100]})
    fresh = Agreement(2, None, "none", 0, infos)
    no_common_point(fresh, 0, 3)  # a standby with its initial state may
    with pytest.raises(CheckpointNotFoundError, match="preloaded a replica") as err:
        no_common_point(fresh, 0, 3, preloaded=True)
    # the message says who held what
    assert "rank 0 memory [250] disk [100]; rank 3 memory [150, 200]" in str(err.value)
