"""The per-rank part of a replicated state: which objects are in it, which persisted
steps a rank can restore completely, and what a rank without its part gets."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from stalwart.checkpoint import CheckpointConfig, CheckpointManager, RNGState
from stalwart.runtime.state._perrank import PerRankPart, derive_rng, per_rank_names

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


class _Events:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def emit(self, kind: str, **fields: Any) -> None:
        assert kind == "note"
        self.notes.append(str(fields["message"]))


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return {"model": model, "opt": opt, "sched": sched, "meta": {"best": 1.0}, "_rng": RNGState()}


def test_replicas_are_models_optimizers_and_schedulers_the_rest_is_per_rank() -> None:
    assert per_rank_names(_state()) == ["meta", "_rng"]


def test_derived_rng_differs_per_rank_and_is_reproducible() -> None:
    draws = {}
    for rank in (1, 2, 1):
        torch.manual_seed(5)
        derive_rng(rank, 40)
        draws.setdefault(rank, []).append(
            (torch.randint(1 << 30, (4,)).tolist(), random.random(), float(np.random.rand()))
        )
    assert draws[1][0] == draws[1][1]
    assert draws[1][0] != draws[2][0]


@pytest.fixture
def part(tmp_path: Path, shm_namespace: str) -> Any:
    state = _state()
    events = _Events()
    ckpt = CheckpointManager(CheckpointConfig(str(tmp_path / "ckpt"), namespace=shm_namespace))
    env: Any = SimpleNamespace(keep_last=3, keep_every=0, ckpt_tier="")
    sess = SimpleNamespace(rank=1, state=state, ckpt=ckpt)  # the position, and the parts
    root = str(tmp_path / "ckpt" / "per-rank" / "rank00001")
    p = PerRankPart(ckpt, state, env, events, sess, root, per_rank_names(state))
    yield p, sess, events
    ckpt.close()


def test_own_part_of_the_step_is_restored(part: Any) -> None:
    p, sess, events = part
    assert p.disk_steps([4, 8]) == [4, 8]  # no part yet (an older checkpoint): all
    torch.manual_seed(11)
    sess.state["meta"]["best"] = 0.5
    sess.ckpt.snapshot(sess.state, 8)
    want = torch.get_rng_state()
    p.persist(8)
    sess.ckpt.persister.close()  # waits for the queued persist
    assert p.steps() == [8]
    assert p.disk_steps([4, 8, 12]) == [8]
    torch.manual_seed(0)
    sess.state["meta"]["best"] = 9.0
    p.restore(8, "disk")
    assert torch.equal(torch.get_rng_state(), want)
    assert sess.state["meta"] == {"best": 0.5}
    assert events.notes == []


def test_a_rank_without_its_part_gets_a_derived_rng_and_a_note(
    part: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p, sess, events = part
    torch.manual_seed(0)
    rank0 = torch.get_rng_state()
    p.restore(12, "peer")
    assert not torch.equal(torch.get_rng_state(), rank0)
    assert len(events.notes) == 1 and "derived" in events.notes[0]
    # a diagnostic, once per process (stalwart.logs: "stalwart: runtime: warning: ...")
    assert [r.name for r in caplog.records] == ["stalwart.runtime"]
    assert "rank 1: restored step 12 from the peer tier" in caplog.records[0].getMessage()
    sess.rank = 0  # rank 0's disk copy is its own state: left as loaded
    torch.manual_seed(0)
    p.restore(12, "disk")
    assert torch.equal(torch.get_rng_state(), rank0)


def test_a_tracked_dict_is_checked_at_track_time() -> None:
    from stalwart.errors import UnsupportedStateError
    from stalwart.runtime.state._perrank import check_values

    check_values({"meta": {"best": 1.0, "hist": [1, 2.5, None], "t": torch.ones(2)}})
    with pytest.raises(UnsupportedStateError, match=r"tracked meta\.fn is a function"):
        check_values({"meta": {"best": 1.0, "fn": lambda: 0}})


def test_a_tracked_dict_round_trips_through_a_snapshot(shm_namespace: str) -> None:
    from stalwart.checkpoint import SnapshotConfig, Snapshotter

    meta: dict[str, Any] = {"best_val_loss": 2.0, "iter_num": 3, "hist": [1.0, 0.5]}
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        snap.snapshot({"meta": meta}, 3)
        meta["best_val_loss"], meta["iter_num"], meta["later"] = 1.0, 4, "x"
        assert snap.restore({"meta": meta}) == 3
    finally:
        snap.close(unlink=True)
    assert meta == {"best_val_loss": 2.0, "iter_num": 3, "hist": [1.0, 0.5]}


def test_track_holds_the_rngs_once(tmp_path: Path, shm_namespace: str) -> None:
    """An RNGState the script tracks replaces the one track() adds; a rollback (alone:
    a restore from the step's snapshot) gives back the RNGs and a tracked dict."""
    from stalwart.contract.env import WorkerEnv
    from stalwart.runtime import Session

    env = WorkerEnv(run_dir=str(tmp_path), job=shm_namespace)
    sess = Session(env)
    try:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        meta = {"best": 1.0}
        state = sess.track(model=model, optimizer=opt, rng=RNGState(), meta=meta)
        assert sorted(state) == ["meta", "model", "optimizer", "rng"]
        for _ in sess.steps(2):
            pass
        want = torch.get_rng_state()
        torch.rand(3)
        sess.tracked.checkpoints.restore_from_memory(sess.tracked.state)
        assert torch.equal(torch.get_rng_state(), want)
    finally:
        sess.close()
