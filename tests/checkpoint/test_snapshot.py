"""Shared-memory snapshots: double buffering, async copy, surviving the writer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _load import scaled
from _models import assert_same, make_state, params, train_step

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.errors import CheckpointNotFoundError, ConfigError, SnapshotDirectoryGoneError


def test_restore_from_memory_is_bit_exact(shm_namespace: str) -> None:
    state = make_state()
    train_step(state)
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        snap.snapshot(state, 3)
        want = params(state)
        train_step(state)
        assert snap.restore(state) == 3
        assert_same(params(state), want)
    finally:
        snap.close(unlink=True)


def test_slots_alternate_and_crash_mid_copy_keeps_previous(
    shm_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = make_state()
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        a = snap.snapshot(state, 1)
        train_step(state)
        b = snap.snapshot(state, 2)
        assert a.slot != b.slot
        want = params(state)
        train_step(state)

        def crash(*_: object) -> None:
            raise KeyboardInterrupt("killed mid-copy")

        monkeypatch.setattr(snap, "_copy", crash)
        with pytest.raises(KeyboardInterrupt):
            snap.snapshot(state, 3)
        monkeypatch.undo()
        latest = snap.latest()
        assert latest is not None and latest.step == 2
        assert snap.restore(state) == 2
        assert_same(params(state), want)
    finally:
        snap.close(unlink=True)


def test_async_snapshot_is_consistent_with_guarded_step(shm_namespace: str) -> None:
    state = make_state()
    train_step(state)
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    handle = snap.guard(state["optimizer"])
    try:
        want = params(state)
        res = snap.snapshot(state, 7, blocking=False)
        train_step(state)  # the optimizer step waits for the copy first
        assert res.blocking_s >= 0
        assert snap.restore(state) == 7
        assert_same(params(state), want)
    finally:
        handle.remove()
        snap.close(unlink=True)


def test_on_done_runs_once_the_stall_is_final(shm_namespace: str) -> None:
    """Nothing deferred: before snapshot() returns; deferred: in the wait that joins the
    copy (here the optimizer's pre-step hook), with that wait in its stall; once each."""
    from stalwart.checkpoint import SnapshotResult

    state = make_state()
    train_step(state)
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    handle = snap.guard(state["optimizer"])
    done: list[tuple[int, float]] = []

    def on_done(r: SnapshotResult) -> None:
        done.append((r.step, r.blocking_s))

    try:
        snap.snapshot(state, 1, on_done=on_done)
        assert [s for s, _ in done] == [1]
        res = snap.snapshot(state, 2, blocking=False, on_done=on_done)
        train_step(state)
        assert done[-1] == (2, res.blocking_s) and len(done) == 2
        snap.wait()
        assert len(done) == 2
    finally:
        handle.remove()
        snap.close(unlink=True)


def test_pinned_slot_is_never_overwritten(shm_namespace: str) -> None:
    state = make_state()
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        snap.snapshot(state, 1)
        found = snap.pin_latest()
        assert found is not None
        pinned, meta = found
        for step in range(2, 6):
            train_step(state)
            assert snap.snapshot(state, step).slot != pinned
        assert snap._slots[pinned].read_meta() == meta
        snap.unpin(pinned)
    finally:
        snap.close(unlink=True)


def test_a_writer_whose_directory_was_taken_over_writes_nothing_into_the_new_one(
    shm_namespace: str,
) -> None:
    """A node's ranks adopted on the same host while its old worker still runs: the
    adopter removes the rank's directory and renames a replica into its name
    (agent/cluster/_replica.py ``take_over``). The old worker's next snapshot is refused,
    and the adopter's slots stay exactly as they were (it used to unlink and publish
    slot metadata there by path, and the adopted rank's restore found a ``slot1.json``
    whose ``slot1.data`` did not exist)."""
    state = make_state()
    old = Snapshotter(SnapshotConfig(shm_namespace))
    replica_ns = f"{shm_namespace}-replica"
    replica = Snapshotter(SnapshotConfig(replica_ns))
    try:
        old.snapshot(state, 1)
        train_step(state)
        replica.snapshot(state, 2)  # the replica holds slot 0 only
        directory = Path(old.directory)
        shutil.rmtree(directory)
        os.rename(replica.directory, directory)
        before = {p.name: p.read_bytes() for p in directory.iterdir()}
        assert sorted(before) == ["slot0.data", "slot0.json"]
        train_step(state)
        with pytest.raises(SnapshotDirectoryGoneError, match="adopted"):
            old.snapshot(state, 3)
        old.close(unlink=True)  # the old owner's teardown removes nothing of the new one
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
        adopter = Snapshotter(SnapshotConfig(shm_namespace))
        try:
            assert adopter.restore(state) == 2
        finally:
            adopter.close(unlink=True)
    finally:
        replica.close(unlink=True)
        shutil.rmtree(Path("/dev/shm") / f"stalwart-{replica_ns}", ignore_errors=True)


def test_snapshot_survives_the_process_that_wrote_it(shm_namespace: str, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _models import make_state, train_step
        from stalwart.checkpoint import SnapshotConfig, Snapshotter
        state = make_state()
        train_step(state)
        Snapshotter(SnapshotConfig({shm_namespace!r})).snapshot(state, 11)
        torch.save(state["model"].state_dict(), {str(tmp_path / "want.pt")!r})
        os._exit(0)  # no cleanup, like a crash
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=scaled(60))
    state = make_state(seed=4)
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        assert snap.restore(state) == 11
    finally:
        snap.close(unlink=True)
    want = torch.load(tmp_path / "want.pt", weights_only=True)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, want[k]), k


def test_errors() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        SnapshotConfig("x", slots=1)
    with pytest.raises(ConfigError, match="without '/'"):
        SnapshotConfig("a/b")


def test_restore_without_snapshot(shm_namespace: str) -> None:
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        with pytest.raises(CheckpointNotFoundError, match="no complete snapshot"):
            snap.restore(make_state())
    finally:
        snap.close(unlink=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_through_side_stream(shm_namespace: str) -> None:  # pragma: no cover
    t = torch.randn(1000, device="cuda")
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        snap.snapshot({"t": t}, 1)
        out = torch.zeros(1000, device="cuda")
        snap.restore({"t": out})
        assert torch.equal(out, t)
    finally:
        snap.close(unlink=True)


def test_restore_a_given_step(shm_namespace: str) -> None:
    state = make_state()
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    try:
        snap.snapshot(state, 1)
        older = params(state)
        train_step(state)
        snap.snapshot(state, 2)
        assert snap.steps() == [1, 2]
        assert snap.restore(state, step=1) == 1
        assert_same(params(state), older)
        with pytest.raises(CheckpointNotFoundError, match="of step 9"):
            snap.restore(state, step=9)
    finally:
        snap.close(unlink=True)


def test_device_tensors_are_routed_to_the_side_stream_copy(
    shm_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a GPU: check that CUDA sources take the pinned side-stream path and CPU
    sources the plain copy (the CUDA path itself runs in the GPU check)."""

    class FakeCuda:
        device = torch.device("meta")

    fake = FakeCuda()
    monkeypatch.setattr(fake, "device", type("D", (), {"type": "cuda"})())
    snap = Snapshotter(SnapshotConfig(shm_namespace))
    seen: list[object] = []
    monkeypatch.setattr(snap, "_copy_cuda", lambda pairs: seen.extend(s for s, _ in pairs))
    cpu_src, cpu_dst = torch.ones(3), torch.zeros(3)
    try:
        snap._copy([(cpu_src, cpu_dst), (fake, torch.zeros(3))])  # type: ignore[list-item]
    finally:
        snap.close(unlink=True)
    assert seen == [fake] and torch.equal(cpu_dst, cpu_src)


def test_slot_directory_must_be_private(tmp_path: Path) -> None:
    """A pre-created slot directory that others may write, or a link, is refused in one
    line; files are never opened through a link."""
    from stalwart.checkpoint.slots import SlotFiles, ensure_private_dir

    shared = tmp_path / "stalwart-open"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        Snapshotter(SnapshotConfig("open", shm_dir=str(tmp_path)))
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "stalwart-linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="a link"):
        ensure_private_dir(str(tmp_path / "stalwart-linked"))
    own = tmp_path / "stalwart-own"
    ensure_private_dir(str(own))
    ensure_private_dir(str(own))  # reusing our own private directory is fine
    (tmp_path / "target.json").write_text("{}")
    (own / "slot0.json").symlink_to(tmp_path / "target.json")
    assert SlotFiles(str(own), 0).read_meta() is None
    (own / "slot0.data").symlink_to(tmp_path / "target.json")
    with pytest.raises(OSError):
        SlotFiles(str(own), 0).map_writable(4096)
    assert (tmp_path / "target.json").read_text() == "{}"
