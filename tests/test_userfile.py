"""userfile.py and the CLI paths that read a file the user names: a FIFO, a device or a
directory is refused in one line, never read (a FIFO's open would block forever).

Each path is opened non-blocking, so a regression here shows as a hang: the suite's
per-test timeout fails it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stalwart.chaos.trace import load_trace
from stalwart.checkpoint.storage import LocalStorage
from stalwart.cli.main import main
from stalwart.errors import CheckpointFormatError
from stalwart.userfile import NotRegularFileError, open_regular


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _one_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stalwart: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize(
    ("kind", "what"),
    [("fifo", "a FIFO"), ("dir", "a directory"), ("dev", "a character device")],
)
def test_anything_but_a_regular_file_is_refused(
    tmp_path: Path, fifo: Path, kind: str, what: str
) -> None:
    path = {"fifo": str(fifo), "dir": str(tmp_path), "dev": os.devnull}[kind]
    with pytest.raises(NotRegularFileError, match=f"the thing is {what}, not a regular file; fix"):
        open_regular(path, what="the thing", fix="fix")


def test_a_regular_file_is_read_and_a_missing_one_is_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    with open_regular(tmp_path / "f", what="x", fix="y") as f:
        assert f.read() == b"abc"
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "nope", what="x", fix="y")


def test_a_long_path_is_cut_in_the_line(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 200)
    deep.mkdir()
    with pytest.raises(NotRegularFileError) as err:
        open_regular(deep, what="x", fix="y")
    assert "characters)" in str(err.value) and len(str(err.value)) < 300


def test_plan_refuses_a_fifo_calibration(fifo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capsys, "plan", "--calibration", str(fifo))
    assert "calibration is a FIFO, not a regular file" in line and "stalwart calibrate" in line


def test_simulate_refuses_a_device_calibration(capsys: pytest.CaptureFixture[str]) -> None:
    assert "a character device" in _one_line(capsys, "simulate", "--calibration", os.devnull)


def test_report_refuses_a_fifo_event_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Named directly, and as a run directory's events.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "events.jsonl")
    assert "event log is a FIFO" in _one_line(capsys, "report", str(run))
    line = _one_line(capsys, "report", str(run / "events.jsonl"))
    assert "not a run directory" in line


def test_a_trace_file_that_is_a_fifo_is_refused(fifo: Path) -> None:
    with pytest.raises(NotRegularFileError, match="trace file is a FIFO"):
        load_trace(fifo)


def test_checkpoint_files_that_are_fifos_are_refused(
    tmp_path: Path, fifo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A planted FIFO where any file of the root is read: refused by the storage; a FIFO
    manifest commits nothing, so `ckpt verify|inspect` say there is no checkpoint."""
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        LocalStorage(str(tmp_path)).read("fifo")
    root = tmp_path / "ckpt"
    (root / "step_000000000001").mkdir(parents=True)
    os.mkfifo(root / "step_000000000001" / "MANIFEST.json")
    for verb in ("verify", "inspect"):
        assert "no committed checkpoint" in _one_line(capsys, "ckpt", verb, str(root))


def test_ckpt_import_refuses_fifo_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ckpt import` says one line; the metadata reader refuses it itself too (a file
    swapped for a FIFO after the command's check)."""
    from stalwart.checkpoint._dcp_import import read_metadata

    src = tmp_path / "dcp"
    src.mkdir()
    os.mkfifo(src / ".metadata")
    line = _one_line(capsys, "ckpt", "import", str(src), str(tmp_path / "out"))
    assert "not a DCP checkpoint" in line
    with pytest.raises(NotRegularFileError, match="DCP's metadata is a FIFO"):
        read_metadata(str(src))
