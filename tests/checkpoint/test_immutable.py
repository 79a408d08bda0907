"""A committed step is never rewritten in place: after a restart from an older step the
job trains through committed steps again, and their re-persist must leave them intact
(a crash between rewriting an index and writing a new manifest would otherwise leave a
committed step that fails its checksum)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _models import assert_same, make_state, params, train_step

from stalwart.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    StepCommitter,
    open_storage,
    verify_step,
)
from stalwart.checkpoint._writer import write_rank
from stalwart.checkpoint.format import index_path, manifest_path
from stalwart.checkpoint.storage import LocalStorage
from stalwart.errors import StepCommittedError

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


_TREE = {"t": "dict", "items": [[".w", {"t": "tensor", "id": 0}]]}
_LAYOUT = [{"id": 0, "path": ".w", "dtype": "uint8", "shape": [64], "nbytes": 64, "offset": 0}]


def _write(storage: LocalStorage, step: int, fill: int, rank: int = 0, world: int = 1) -> None:
    write_rank(
        storage,
        step=step,
        rank=rank,
        world_size=world,
        tree=_TREE,
        layout=_LAYOUT,
        data=memoryview(bytearray([fill]) * 64),
        known={},
    )


def test_writing_a_committed_steps_index_is_refused(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    _write(storage, 5, fill=1)
    StepCommitter(storage).commit(5)
    index = storage.read(index_path(5, 0))
    with pytest.raises(StepCommittedError, match="already committed"):
        _write(storage, 5, fill=2)  # the re-persist, before any new manifest
    assert storage.read(index_path(5, 0)) == index
    assert verify_step(storage, 5).ok


def test_committing_a_committed_step_again_changes_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    _write(storage, 5, fill=1)
    StepCommitter(storage).commit(5)
    manifest = storage.read(manifest_path(5))
    # a relaunch at world 2 reaching step 5 again: its commit must not rebuild step 5
    done = StepCommitter(storage, world_size=2).commit(5, generation=3)
    assert done.manifest.world_size == 1 and done.gc is None
    assert storage.read(manifest_path(5)) == manifest


@pytest.mark.parametrize("commit", [False, True])  # a sharded rank's write; a lone commit
def test_a_repersist_through_the_persister_skips_the_committed_step(
    tmp_path: Path, shm_namespace: str, commit: bool
) -> None:
    state = make_state()
    mgr = CheckpointManager(CheckpointConfig(str(tmp_path), namespace=shm_namespace))
    try:
        mgr.save(state, 5)
        want = params(state)
        train_step(state)  # another trajectory through step 5 (or the same: no matter)
        mgr.snapshot(state, 5)
        again = mgr.persist(commit=commit).result()
        assert again.raw.get("skipped") == "committed" and again.written_bytes == 0
        storage = open_storage(str(tmp_path))
        assert verify_step(storage, 5).ok
        fresh = make_state(seed=9)
        assert mgr.restore(fresh).step == 5
        assert_same(params(fresh), want)
    finally:
        mgr.close()
