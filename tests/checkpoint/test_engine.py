"""Save / restore through the real persister process: bit-exact, incremental, fallback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _models import assert_same, make_state, params, train_step

from stalwart.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    CommitPlan,
    FencedCommit,
    RetentionPolicy,
    committed_steps,
    open_storage,
    verify_step,
)
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    FencedError,
    StateMismatchError,
)

pytestmark = pytest.mark.process  # the checkpoint persister: a helper process (tests/_tiers.py)


def _mgr(root: Path, ns: str, keep_last: int = 3) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(str(root), namespace=ns, retention=RetentionPolicy(keep_last))
    )


def test_save_restore_bit_exact_including_rng(tmp_path: Path, shm_namespace: str) -> None:
    state = make_state()
    train_step(state)
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.save(state, 1)
        want = params(state)
        x_want = torch.randn(3)
        sched_want = state["scheduler"].state_dict()
        for _ in range(3):
            train_step(state)
        res = mgr.restore(state)
        assert res.step == 1 and res.skipped == []
        assert_same(params(state), want)
        assert torch.equal(torch.randn(3), x_want)
        assert state["scheduler"].state_dict() == sched_want
        # training continues identically after a restore (the RNG is process-global)
        mgr.restore(state)
        train_step(state)
        fresh = make_state(seed=5)
        mgr.restore(fresh)
        train_step(fresh)
        assert_same(params(state), params(fresh))
    finally:
        mgr.close()


def test_restore_into_unstepped_optimizer(tmp_path: Path, shm_namespace: str) -> None:
    state = make_state()
    train_step(state)
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.save(state, 5)
        fresh = make_state(seed=1)
        assert not fresh["optimizer"].state
        mgr.restore(fresh)
        assert_same(params(fresh), params(state))
    finally:
        mgr.close()


def test_incremental_writes_only_changed_chunks(tmp_path: Path, shm_namespace: str) -> None:
    state = make_state(frozen=True)
    train_step(state)
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        first = mgr.save(state, 1)
        frozen_bytes = sum(p.numel() * 4 for p in state["model"][0].parameters())
        train_step(state)
        second = mgr.save(state, 2)
        assert first.written_bytes >= first.total_bytes - 64
        assert second.written_bytes <= second.total_bytes - frozen_bytes
        assert verify_step(open_storage(str(tmp_path)), 2).ok
    finally:
        mgr.close()


def _flip(path: str, offset: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("target", ["pack", "index", "manifest"])
def test_flipped_byte_detected_and_restore_falls_back(
    tmp_path: Path, shm_namespace: str, target: str
) -> None:
    state = make_state()
    train_step(state)
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.save(state, 1)
        want = params(state)
        train_step(state)
        mgr.save(state, 2)
    finally:
        mgr.close()
    step2 = tmp_path / "step_000000000002"
    if target == "pack":
        path = str(
            next(p for p in (tmp_path / "data").iterdir() if p.name.startswith("000000000002"))
        )
        offset = os.path.getsize(path) // 2
    elif target == "index":
        path, offset = str(step2 / "rank_00000.json"), 40
    else:
        path, offset = str(step2 / "MANIFEST.json"), 30
    _flip(path, offset)
    storage = open_storage(str(tmp_path))
    report = verify_step(storage, 2)
    assert not report.ok and report.problems
    assert verify_step(storage, 1).ok
    fresh = make_state(seed=3)
    res = fresh_restore = CheckpointManager(
        CheckpointConfig(str(tmp_path), namespace=shm_namespace + "b")
    )
    try:
        result = fresh_restore.restore(fresh)
    finally:
        res.close()
    assert result.step == 1 and result.skipped
    assert_same(params(fresh), want)


def test_missing_pack_is_named(tmp_path: Path, shm_namespace: str) -> None:
    state = make_state()
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.save(state, 1)
    finally:
        mgr.close()
    for p in (tmp_path / "data").iterdir():
        p.unlink()
    report = verify_step(open_storage(str(tmp_path)), 1)
    assert any("missing pack" in p for p in report.problems)
    with pytest.raises(CheckpointCorruptError, match=r"no checkpoint .* loads"):
        CheckpointManager(CheckpointConfig(str(tmp_path), namespace=shm_namespace)).restore(state)


def test_state_mismatch_names_keys(tmp_path: Path, shm_namespace: str) -> None:
    state = make_state()
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.save(state, 1)
        other = make_state()
        other["model"] = torch.nn.Sequential(torch.nn.Linear(16, 4))
        other["optimizer"] = torch.optim.SGD(other["model"].parameters(), lr=0.1)
        with pytest.raises(StateMismatchError, match=r"missing: .*|unexpected: "):
            mgr.restore(other)
        with pytest.raises(StateMismatchError, match="not tracked now: extra"):
            mgr.restore({k: v for k, v in state.items() if k != "extra"})
    finally:
        mgr.close()


def test_empty_dir_is_a_clear_error(tmp_path: Path, shm_namespace: str) -> None:
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            mgr.restore(make_state())
    finally:
        mgr.close()


def test_retention_keeps_last_k_and_shared_chunks(tmp_path: Path, shm_namespace: str) -> None:
    state = make_state(frozen=True)
    mgr = _mgr(tmp_path, shm_namespace, keep_last=2)
    try:
        for step in range(1, 6):
            train_step(state)
            mgr.save(state, step)
        want = params(state)
    finally:
        mgr.close()
    storage = open_storage(str(tmp_path))
    assert committed_steps(storage) == [4, 5]
    assert verify_step(storage, 4).ok and verify_step(storage, 5).ok
    # step 1's pack holds the frozen layer, still referenced: it must survive GC
    assert any(p.name.startswith("000000000001") for p in (tmp_path / "data").iterdir())
    fresh = make_state(seed=9, frozen=True)
    mgr2 = CheckpointManager(CheckpointConfig(str(tmp_path), namespace=shm_namespace + "b"))
    try:
        assert mgr2.restore(fresh).step == 5
    finally:
        mgr2.close()
    assert_same(params(fresh), want)


def test_damaged_shared_chunk_is_quarantined_not_spread(tmp_path: Path, shm_namespace: str) -> None:
    """A frozen layer's chunk is stored once and shared by every step; when it is
    damaged, restore reports every step, hides them, and the next save rewrites it."""
    state = make_state(frozen=True)
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.save(state, 1)
        train_step(state)
        mgr.save(state, 2)
        pack1 = next(p for p in (tmp_path / "data").iterdir() if p.name.startswith("000000000001"))
        _flip(str(pack1), 10)  # the frozen first layer's weight is at the start of step 1's pack
        with pytest.raises(CheckpointCorruptError) as info:
            mgr.restore(make_state(seed=2, frozen=True))
        assert any("step 2" in p for p in info.value.problems)
        assert any("step 1" in p for p in info.value.problems)
        storage = open_storage(str(tmp_path))
        assert committed_steps(storage) == []
        moved = sorted((tmp_path / "quarantine").iterdir())  # moved aside, inside the root
        assert [m.name.split("-")[0] for m in moved] == ["step_000000000001", "step_000000000002"]
        assert all((m / "QUARANTINED.json").exists() for m in moved)
        assert not (tmp_path / "step_000000000002").exists()
        train_step(state)
        result = mgr.save(state, 3)
        assert result.written_bytes >= result.total_bytes - 64  # no reuse of old chunks
        assert verify_step(storage, 3).ok
        want = params(state)
        fresh = make_state(seed=4, frozen=True)
        assert mgr.restore(fresh).step == 3
        assert_same(params(fresh), want)
    finally:
        mgr.close()


def test_reshard_ignores_duplicate_pieces_and_reports_gaps() -> None:
    """Two ranks saved the same rows (a replicated mesh dimension); rows 3..5 are
    missing. The duplicates must not hide the gap."""
    from concurrent.futures import ThreadPoolExecutor

    from stalwart.checkpoint.format import TensorEntry
    from stalwart.checkpoint.restore import _fill_box
    from stalwart.checkpoint.storage import LocalStorage

    piece = TensorEntry(
        0, ".w", "float32", [3, 3], 36, [], {"global_shape": [6, 3], "offsets": [0, 0]}
    )
    dst = torch.full((6, 3), -1.0)
    with (
        ThreadPoolExecutor(1) as pool,
        pytest.raises(CheckpointCorruptError, match="do not cover"),
    ):
        _fill_box(LocalStorage("/nonexistent"), [piece, piece], dst, {"offsets": [0, 0]}, pool)


def test_replicated_state_restores_into_another_world_size(
    tmp_path: Path, shm_namespace: str
) -> None:
    """DDP state saved by 2 ranks loads on any rank of a world of 3 (and of 1)."""
    from stalwart.checkpoint import publish_step

    state = make_state()
    train_step(state)
    want = params(state)
    mgrs = [
        CheckpointManager(
            CheckpointConfig(
                str(tmp_path),
                namespace=f"{shm_namespace}{r}",
                rank=r,
                world_size=2,
                replicated=True,
            )
        )
        for r in range(2)
    ]
    try:
        for m in mgrs:
            m.snapshot(state, 4)
            assert not m.persist().result(timeout=60).committed
        assert committed_steps(open_storage(str(tmp_path))) == []  # not before the commit
        publish_step(mgrs[0].storage, 4, 2, replicated=True)
    finally:
        for m in mgrs:
            m.close()
    for world, rank in ((3, 2), (1, 0)):
        fresh = make_state(seed=rank + 7)
        mgr = CheckpointManager(
            CheckpointConfig(
                str(tmp_path), namespace=f"{shm_namespace}x", rank=rank, world_size=world
            )
        )
        try:
            assert mgr.restore(fresh).step == 4
        finally:
            mgr.close()
        assert_same(params(fresh), want)


def test_a_persist_under_a_commit_plan_says_what_was_committed(
    tmp_path: Path, shm_namespace: str
) -> None:
    """Under a coordinator the persister writes the step uncommitted and the engine
    commits it, fenced, before the persist's future resolves: its result says what was
    committed, or that the fence refused it (an outcome, not the future's error)."""
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="job"))
    fenced = FencedCommit(coord, shard="rank0", job_record=True)
    state = make_state()
    mgr = _mgr(tmp_path, shm_namespace)
    try:
        mgr.snapshot(state, 1)
        done = mgr.persist(commit=CommitPlan(fenced, generation=0)).result(timeout=60)
        assert not done.committed  # not by the persister: by the plan, fenced
        assert done.commit is not None and done.commit.result is not None
        assert done.commit.result.manifest.step == 1 and committed_steps(mgr.storage) == [1]
        assert coord.shard_commits()["rank0"].step == 1
        assert coord.advance_generation(0, "a member failed").won
        train_step(state)
        mgr.snapshot(state, 2)
        stale = mgr.persist(commit=CommitPlan(fenced, generation=0)).result(timeout=60)
        assert stale.commit is not None and stale.commit.refused
        assert isinstance(stale.commit.error, FencedError)
        assert committed_steps(mgr.storage) == [1]
    finally:
        mgr.close()


def test_a_persist_after_a_background_snapshot_writes_that_snapshot(
    tmp_path: Path, shm_namespace: str
) -> None:
    """persist() does not wait for a snapshot still copying: it is handed over once the
    copy is complete, from that slot (pinned), whatever training does meanwhile."""
    state = make_state()
    train_step(state)
    mgr = _mgr(tmp_path, shm_namespace)
    handle = mgr.snapshots.guard(state["optimizer"])
    try:
        mgr.snapshot(state, 1)
        mgr.persist().result()
        want = params(state)
        mgr.snapshot(state, 2, blocking=False)
        fut = mgr.persist()
        for _ in range(3):  # its optimizer steps wait for the copy; later snapshots
            train_step(state)  # never overwrite the pinned slot
            mgr.snapshot(state, 3, blocking=False)
        assert fut.result().step == 2
        assert mgr.restore(state, step=2).step == 2
        assert_same(params(state), want)
    finally:
        handle.remove()
        mgr.close()


def test_after_copy_runs_its_calls_in_order_once_the_copy_is_done(shm_namespace: str) -> None:
    from stalwart.checkpoint import SnapshotConfig, Snapshotter

    state = make_state()
    train_step(state)
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    ran: list[tuple[str, BaseException | None]] = []
    try:
        snap.after_copy(lambda err: ran.append(("idle", err)))  # nothing in flight: now
        snap.snapshot(state, 1, blocking=False)
        snap.after_copy(lambda err: ran.append(("first", err)))
        snap.after_copy(lambda err: ran.append(("second", err)))
        snap.wait()
        assert ran == [("idle", None), ("first", None), ("second", None)]
    finally:
        snap.close(unlink=True)
