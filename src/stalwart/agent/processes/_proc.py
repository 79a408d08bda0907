"""A worker's CPU time and state from /proc (what :class:`~stalwart.agent.detection.hang.CpuTracker`
is fed). Linux only; elsewhere nothing is read and no worker is ever blamed for idling."""

from __future__ import annotations

import os

__all__ = ["read_cpu"]

_TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def _stat(pid: int) -> tuple[str, float] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 13:
        return None
    # fields 3, 14 and 15 of proc(5): state, utime, stime (in clock ticks)
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK


def read_cpu(pid: int) -> tuple[str, float] | None:
    """(state of the main thread, CPU seconds of the process and its live children),
    or None when the process is gone. Children count: a rank waiting for its data
    loader workers is busy when they are."""
    own = _stat(pid)
    if own is None:
        return None
    state, cpu = own
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        children = []
    for child in children:
        sub = _stat(child)
        if sub is not None:
            cpu += sub[1]
    return state, cpu
