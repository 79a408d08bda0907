"""Single /dev/shm files (the progress board, a step journal) are the job user's own or
refused (issue 27): created with O_EXCL, and a file already at the name used only when it
is a private regular file of this user."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from stalwart.contract.board import ProgressBoard
from stalwart.metrics import journal
from stalwart.metrics.journal import StepJournal
from stalwart.privfile import ForeignFileError, open_own


def _world_writable(path: Path) -> None:
    path.write_bytes(b"")
    os.chmod(path, 0o666)


def _group_readable(path: Path) -> None:
    path.write_bytes(b"")
    os.chmod(path, 0o640)


def _fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


def _other_user(path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    path.write_bytes(b"")
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)


PLANTED: dict[str, Callable[[Path], None]] = {
    "0666": _world_writable,
    "0640": _group_readable,
    "fifo": _fifo,
    "other-user": _other_user,
}


@pytest.mark.parametrize("plant", PLANTED.values(), ids=PLANTED.keys())
def test_a_planted_file_is_refused_by_the_board_and_the_journal(
    tmp_path: Path, plant: Callable[[Path], None]
) -> None:
    board, steps = tmp_path / "board", tmp_path / "steps"
    plant(board)
    plant(steps)
    with pytest.raises(ForeignFileError, match="refusing to use it") as err:
        ProgressBoard(str(board), 2, create=True)
    assert "\n" not in str(err.value) and str(board) in str(err.value)
    with pytest.raises(ForeignFileError):
        ProgressBoard(str(board), 2)  # a worker mapping it refuses it too
    with pytest.raises(ForeignFileError):
        StepJournal(str(steps))
    assert board.stat().st_size == 0 or not board.is_file()  # never written


def test_a_link_at_the_name_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"")
    os.chmod(target, 0o600)
    (tmp_path / "board").symlink_to(target)
    with pytest.raises(OSError):
        ProgressBoard(str(tmp_path / "board"), 1, create=True)
    assert target.stat().st_size == 0


def test_a_fresh_file_is_private_and_an_own_private_one_is_adopted(tmp_path: Path) -> None:
    os.umask(old := os.umask(0))  # whatever the umask: 0600
    try:
        board = ProgressBoard(str(tmp_path / "board"), 2, create=True)
    finally:
        os.umask(old)
    assert (tmp_path / "board").stat().st_mode & 0o777 == 0o600
    board.close()
    again = ProgressBoard(str(tmp_path / "board"), 2, create=True)  # a restarted agent's
    again.close()
    fd = open_own(str(tmp_path / "board"), create=False)
    os.close(fd)


def test_the_agent_ignores_a_journal_it_does_not_own(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    path = tmp_path / "steps"
    j = StepJournal(str(path))
    j.write(journal.OPEN, {"first_step": 1, "last_step": 2, "count": 2, "busy_s": 1.0,
                           "t_first_start": 1.0, "generation": 0}, t_end=2.0)  # fmt: skip
    assert journal.read(str(path)) is not None
    os.chown(path, 65534, 65534)
    assert journal.read(str(path)) is None
    j.close()
