"""A sharded checkpoint restored by more ranks than wrote it: a rank with no index of
its own must not take rank ``r % W``'s RNG stream (duplicate streams), it gets a derived
one and a note, as a DDP rank without its per-rank part does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, RNGState, open_storage
from stalwart.checkpoint.commit import StepCommitter
from stalwart.contract.env import WorkerEnv
from stalwart.runtime.state._tracking import TrackedState

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


@dataclass
class _Position:
    rank: int
    world_size: int
    generation: int = 0


class _Events:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def emit(self, kind: str, **fields: Any) -> None:
        assert kind == "note"
        self.notes.append(str(fields["message"]))


def _save_at_world_2(root: str, ns: str) -> list[torch.Tensor]:
    """Step 4 written by 2 ranks, each with its own RNG; their RNG states."""
    rngs = []
    for rank in range(2):
        torch.manual_seed(100 + rank)
        rngs.append(torch.get_rng_state())
        state = {"w": {"x": torch.full((4,), float(rank))}, "_rng": RNGState()}
        mgr = CheckpointManager(
            CheckpointConfig(root, namespace=f"{ns}-w{rank}", rank=rank, world_size=2)
        )
        try:
            mgr.snapshot(state, 4)
            mgr.persist(commit=False).result()
        finally:
            mgr.close()
    StepCommitter(open_storage(root), world_size=2).commit(4)
    return rngs


def _restore_as(tmp_path: Path, ns: str, rank: int, events: _Events) -> torch.Tensor:
    env = WorkerEnv(run_dir=str(tmp_path), job=f"{ns}-r{rank}")
    tracked = TrackedState(env)
    tracked.sharded = True
    tracked.state = {"w": {"x": torch.zeros(4)}, "_rng": RNGState()}
    tracked.open(_Position(rank, 3), events)  # type: ignore[arg-type]
    try:
        tracked.restore_disk(4)
        return torch.get_rng_state()
    finally:
        tracked.close()


def test_a_rank_beyond_the_saved_world_gets_a_derived_rng(
    tmp_path: Path, shm_namespace: str
) -> None:
    saved = _save_at_world_2(str(tmp_path / "ckpt"), shm_namespace)
    events = _Events()
    mine = _restore_as(tmp_path, shm_namespace, 1, events)
    assert torch.equal(mine, saved[1]) and events.notes == []  # its own index: its own RNG
    beyond = _restore_as(tmp_path, shm_namespace, 2, events)
    assert not torch.equal(beyond, saved[0]) and not torch.equal(beyond, saved[1])
    assert len(events.notes) == 1 and "rank 2" in events.notes[0]
    assert "derived from rank 0's" in events.notes[0]
    again = _restore_as(tmp_path, shm_namespace, 2, _Events())
    assert torch.equal(again, beyond)  # reproducible
