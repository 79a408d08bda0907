"""The load from *outside* a bench: runnable threads on the machine that are not the bench's
own processes, sampled from /proc while a repetition runs.

Why not the load average: a bench that starts four workers on a 2-core machine moves the
1-minute load average from 1.8 to 5.5 by itself, so a first repetition that begins on a
quiet machine looked like "the load changed > 2x within the pair" and was thrown out,
while a second job that started beside the bench halfway through would be hidden in the
bench's own load. What makes a pair unfair is the *other* work on the machine, so that is
what is sampled: every thread in state R (running or runnable) or D (uninterruptible, as
the load average counts it) whose process is not the bench or one of its descendants.

A sample reads /proc/<pid>/stat for every process and /proc/<pid>/task/*/stat for the
ones outside the bench: about 3.5 ms of CPU on a 2-core machine with 80 processes, so one a
second costs the bench under 0.5% of a core.
"""

from __future__ import annotations

import os
import statistics
import threading

__all__ = ["OutsideLoad", "runnable_outside"]


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a stat file after the command name (state first), None if gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:  # the process or thread ended meanwhile
        return None
    end = data.rfind(b")")
    return data[end + 2 :].split() if end >= 0 else None


def runnable_outside(root: int, proc: str = "/proc") -> int:
    """Threads in state R or D whose process is neither ``root`` nor a descendant of it."""
    parent: dict[int, int] = {}
    for name in os.listdir(proc):
        if name.isdigit():
            fields = _stat_fields(f"{proc}/{name}/stat")
            if fields is not None and len(fields) > 1:
                parent[int(name)] = int(fields[1])
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    count = 0
    for pid in parent:
        if pid in tree:
            continue
        try:
            tasks = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            fields = _stat_fields(f"{proc}/{pid}/task/{tid}/stat")
            if fields and fields[0] in (b"R", b"D"):
                count += 1
    return count


class OutsideLoad:
    """Samples :func:`runnable_outside` every ``period`` seconds in a thread, from
    :meth:`start` to :meth:`stop`, which returns the mean of the first and of the second
    half of the samples (a pair's two sides run one after the other: a change of regime
    between them shows as two different halves)."""

    def __init__(self, period: float = 1.0, root: int | None = None, proc: str = "/proc") -> None:
        self.period = period
        self.root = os.getpid() if root is None else root
        self.proc = proc
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> OutsideLoad:
        self._thread = threading.Thread(target=self._run, name="bench-outside-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.samples.append(runnable_outside(self.root, self.proc))
            if self._stop.wait(self.period):
                return

    def stop(self) -> tuple[float, float] | None:
        """(first half's mean, second half's mean); None with fewer than two samples."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        got = list(self.samples)
        if len(got) < 2:
            return None
        half = len(got) // 2
        return float(statistics.fmean(got[:half])), float(statistics.fmean(got[half:]))
