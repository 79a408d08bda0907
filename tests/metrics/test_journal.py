"""The step journal: rank 0's open batch survives its process (metrics/journal.py)."""

from __future__ import annotations

import struct
from pathlib import Path

from stalwart.metrics import EventLog
from stalwart.metrics.journal import EMPTY, OPEN, WRITING, StepJournal, read, written

BATCH = {
    "first_step": 11,
    "last_step": 35,
    "count": 25,
    "busy_s": 2.5,
    "t_first_start": 1000.0,
    "generation": 1,
}


def test_open_batch_reads_back(tmp_path: Path) -> None:
    j = StepJournal(str(tmp_path / "j"))
    j.write(OPEN, BATCH, t_end=1003.0)
    rec = read(str(tmp_path / "j"))
    assert rec is not None and rec.state == OPEN and rec.t_end == 1003.0
    assert rec.fields() == BATCH
    j.write(EMPTY, None)
    assert read(str(tmp_path / "j")) is None
    j.close()
    assert not (tmp_path / "j").exists()


def test_torn_or_bad_records_are_ignored(tmp_path: Path) -> None:
    path = str(tmp_path / "j")
    j = StepJournal(path)
    j.write(OPEN, BATCH, t_end=1003.0)
    with open(path, "r+b") as f:  # a write cut between the two sequence numbers
        f.seek(0)
        f.write(struct.pack("<q", 99))
    assert read(path) is None
    j.write(OPEN, {**BATCH, "count": 3}, t_end=1003.0)  # count disagrees with the range
    assert read(path) is None
    j.write(OPEN, BATCH, t_end=999.0)  # ends before it starts
    assert read(path) is None
    assert read(str(tmp_path / "absent")) is None
    j.close()


def test_a_batch_being_written_is_looked_up_in_the_log(tmp_path: Path) -> None:
    j = StepJournal(str(tmp_path / "j"))
    j.write(WRITING, BATCH, t_end=1003.0)
    rec = read(str(tmp_path / "j"))
    assert rec is not None and rec.state == WRITING
    log = tmp_path / "events.jsonl"
    ev = EventLog(str(log), node=0, rank=0)
    ev.emit("note", message="unrelated")
    assert not written(str(log), 12345, rec)
    ev.emit("steps", **BATCH)
    import os

    assert written(str(log), os.getpid(), rec)
    assert not written(str(log), os.getpid() + 1, rec)  # another process's batch
    ev.close()
    j.close()
