"""contract/shm_names.py and checkpoint/slots.py: every /dev/shm name of a job from one
SlotNames, the per-run component that makes them unguessable, and the owner and link
checks behind them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.checkpoint.slots import (
    SlotFiles,
    ensure_private_dir,
    open_private,
    read_replica_marker,
    write_replica_marker,
)
from stalwart.contract.shm_names import REPLICA_MARKER, SlotNames, new_run_id, slot_dir
from stalwart.errors import ConfigError
from stalwart.transfer import ReceiverConfig, SlotReceiver, TransferError


@pytest.fixture
def other_uid(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A uid that is not ours: a real one under root (the directory is chown'ed to it),
    else this process pretends to be someone else."""
    if os.getuid() == 0:
        yield 65534
    else:
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
        yield real


def _owned_by(path: Path, uid: int) -> None:
    path.mkdir(mode=0o700)
    if os.getuid() == 0 and uid != 0:
        os.chown(path, uid, -1)


def test_every_name_is_built_from_job_and_run(tmp_path: Path) -> None:
    run = new_run_id()
    n = SlotNames("job1", run, str(tmp_path))
    stem = f"job1-{run}"
    assert n.rank(3) == f"{stem}-r3"
    assert n.replica(3) == f"{stem}-replica-r3"
    assert (
        n.rank_dir(3) == slot_dir(str(tmp_path), f"{stem}-r3") == f"{tmp_path}/stalwart-{stem}-r3"
    )
    assert n.replica_dir(0) == f"{tmp_path}/stalwart-{stem}-replica-r0"
    assert n.progress_board(1) == f"{tmp_path}/stalwart-{stem}-progress-n1"
    assert n.step_journal(42) == f"{tmp_path}/stalwart-{stem}-steps-42"
    assert n.standby_go(2, "ab12") == f"{tmp_path}/stalwart-{stem}-standby-r2-ab12"
    assert n.journal_pid(n.step_journal(42)) == 42
    assert n.journal_pid(n.step_journal(42) + "x") is None
    assert n.journal_pid(SlotNames("job1", new_run_id(), str(tmp_path)).step_journal(7)) is None
    # outside `stalwart run`: the job id's names (what plain python / torchrun had)
    plain = SlotNames("job1", shm_dir=str(tmp_path))
    assert plain.rank(0) == "job1-r0" and plain.replica(0) == "job1-replica-r0"


def test_the_run_id_is_unpredictable_and_validated() -> None:
    ids = {new_run_id() for _ in range(64)}
    assert len(ids) == 64 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    for bad in ("../x", "ABCDEF0123456789", "0" * 15, "0" * 17, "zz" * 8):
        with pytest.raises(ConfigError, match="16 hex digits"):
            SlotNames("job", bad)
    for job in ("", "a/b"):
        with pytest.raises(ConfigError, match="job id"):
            SlotNames(job)


def test_everything_is_this_run_only(tmp_path: Path) -> None:
    """Teardown removes this run's names, never another job's that shares a prefix (job
    ``a`` and job ``a-b`` on one host) nor another run of the same job."""
    run = new_run_id()
    mine = SlotNames("a", run, str(tmp_path))
    for path in (mine.rank_dir(0), mine.replica_dir(1)):
        os.mkdir(path)
    Path(mine.progress_board(0)).write_bytes(b"")
    Path(mine.step_journal(9)).write_bytes(b"")
    os.mkdir(SlotNames("a-b", run, str(tmp_path)).rank_dir(0))
    os.mkdir(SlotNames("a", new_run_id(), str(tmp_path)).rank_dir(0))
    os.mkdir(SlotNames("a", shm_dir=str(tmp_path)).rank_dir(0))
    assert sorted(mine.everything()) == sorted(
        [mine.rank_dir(0), mine.replica_dir(1), mine.progress_board(0), mine.step_journal(9)]
    )
    assert mine.step_journals() == [mine.step_journal(9)]


def test_a_directory_owned_by_someone_else_is_refused(tmp_path: Path, other_uid: int) -> None:
    names = SlotNames("job", new_run_id(), str(tmp_path))
    squatted = Path(names.rank_dir(0))
    _owned_by(squatted, other_uid)
    with pytest.raises(ConfigError) as err:
        Snapshotter(SnapshotConfig(names.rank(0), shm_dir=str(tmp_path)))
    msg = str(err.value)
    assert str(squatted) in msg and f"owned by uid {other_uid}" in msg and "remove it" in msg
    assert "\n" not in msg
    # the buddy's replica receiver refuses it too (a one-line transfer error)
    _owned_by(Path(names.replica_dir(0)), other_uid)
    rx = SlotReceiver(b"k" * 32, ReceiverConfig(shm_dir=str(tmp_path), slots=2))
    with pytest.raises(TransferError, match="owned by uid"):
        rx.prepare(names.replica(0), 4096)


def test_new_directories_are_private(tmp_path: Path) -> None:
    path = tmp_path / "stalwart-x"
    ensure_private_dir(str(path))
    st = path.stat()
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()


def test_a_planted_link_is_never_followed(tmp_path: Path) -> None:
    """A link placed where a slot file, the replica marker or an activation file will be
    created is refused (ELOOP), and its target is untouched."""
    own = tmp_path / "stalwart-own"
    ensure_private_dir(str(own))
    target = tmp_path / "target"
    target.write_text("keep")
    (own / "slot0.data").symlink_to(target)
    with pytest.raises(OSError):
        SlotFiles(str(own), 0).map_writable(4096)
    (own / REPLICA_MARKER).symlink_to(target)
    with pytest.raises(OSError):
        write_replica_marker(str(own), {"step": 1, "by": 0})
    (tmp_path / "go").symlink_to(target)
    with pytest.raises(OSError):
        open_private(str(tmp_path / "go"))
    assert target.read_text() == "keep"


def test_replica_marker_round_trip(tmp_path: Path) -> None:
    d = tmp_path / "stalwart-r"
    ensure_private_dir(str(d))
    assert not read_replica_marker(str(d), consume=False)
    write_replica_marker(str(d), {"step": 5, "by": 1})
    assert (d / REPLICA_MARKER).stat().st_mode & 0o777 == 0o600
    assert read_replica_marker(str(d), consume=False)
    assert read_replica_marker(str(d), consume=True)
    assert not read_replica_marker(str(d), consume=True)  # consumed: true once
