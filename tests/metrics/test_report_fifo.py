"""`stalwart report --html` into a FIFO no one reads: one line at once, not a hang."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli.main import main


def test_report_html_into_a_fifo_no_one_reads_is_one_line(
    make_run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run("never_failed")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["report", str(run), "--html", str(fifo)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot write {fifo}" in err[0], err
