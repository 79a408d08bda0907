"""The step journal: rank 0's unwritten ``steps`` batch, where its death cannot take it.

Why: rank 0 writes its step records as one ``steps`` event per batch (about one a
second: an event per step would make a long run's log gigabytes). A batch still open when
the process dies (a kill, a hang verdict, a whole-job restart) used to die with it: the
report undercounted and read the RTO from the last batch written. So rank 0 also keeps
the open batch in a 72-byte shared-memory record, rewritten at every step (a memory
write, no system call), and the agent writes the batch on its behalf when the process
ended without writing it. A clean end leaves the record empty.

Record (little-endian): ``seq state first_step last_step count busy_s t_first_start
t_end generation seq`` (``q q q q q d d d q q``; ``t_end``: when the last step ended).
``seq`` is written first and last: a record whose two copies differ was cut mid-write
and is ignored. ``state``: 0 empty, 1 open (not written), 2 being written (the event
may or may not have reached the log: the reader looks for it there). The file is
``SlotNames.step_journal(pid)`` (contract/shm_names.py:
``/dev/shm/stalwart-<job>-<run>-steps-<pid>``); the agent removes it when the process is
gone.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from stalwart.privfile import open_own

__all__ = [
    "EMPTY",
    "OPEN",
    "WRITING",
    "JournalRecord",
    "StepJournal",
    "read",
    "written",
]

_FMT = "<qqqqqdddqq"
_SIZE = struct.calcsize(_FMT)
EMPTY, OPEN, WRITING = 0, 1, 2


@dataclass(frozen=True)
class JournalRecord:
    state: int
    first_step: int
    last_step: int
    count: int
    busy_s: float
    t_first_start: float
    t_end: float
    generation: int

    def fields(self) -> dict[str, Any]:
        """The ``steps`` event's fields."""
        return {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "count": self.count,
            "busy_s": self.busy_s,
            "t_first_start": self.t_first_start,
            "generation": self.generation,
        }


class StepJournal:
    """The writer's side (rank 0 of a worker under `stalwart run`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = open_own(path, create=True)  # O_EXCL; a foreign file is refused
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._seq = 0

    def write(self, state: int, batch: dict[str, Any] | None, t_end: float = 0.0) -> None:
        self._seq += 1
        b = batch or {}
        struct.pack_into(
            _FMT,
            self._map,
            0,
            self._seq,
            state,
            int(b.get("first_step", 0)),
            int(b.get("last_step", 0)),
            int(b.get("count", 0)),
            float(b.get("busy_s", 0.0)),
            float(b.get("t_first_start", 0.0)),
            float(t_end),
            int(b.get("generation", 0)),
            self._seq,
        )

    def close(self, *, unlink: bool = True) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def read(path: str) -> JournalRecord | None:
    """The record at ``path``; None when absent, empty, torn or out of bounds."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return None  # planted by another user: not this job's record
            raw = f.read(_SIZE)
    except OSError:
        return None
    if len(raw) != _SIZE:
        return None
    seq, state, first, last, count, busy, t0, t1, gen, seq2 = struct.unpack(_FMT, raw)
    if seq != seq2 or state not in (OPEN, WRITING):
        return None
    if not (0 <= first <= last and count == last - first + 1 and 0 <= busy < 1e9):
        return None
    if not (0 < t0 <= t1 and gen >= 0):
        return None
    return JournalRecord(state, first, last, count, busy, t0, t1, gen)


def written(events_path: str, pid: int, rec: JournalRecord, tail_bytes: int = 1 << 16) -> bool:
    """Whether process ``pid`` already wrote ``rec``'s batch to the log at
    ``events_path`` (read from its last ``tail_bytes``)."""
    try:
        with open(events_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in reversed(lines):
        if b'"steps"' not in line:
            continue
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if (
                e.get("kind") == "steps"
                and e.get("pid") == pid
                and e.get("first_step") == rec.first_step
                and e.get("generation") == rec.generation
            ):
                return True
    return False
