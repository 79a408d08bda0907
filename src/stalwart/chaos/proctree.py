"""The processes below a launcher, read from /proc: whom a fault sent from outside the
job may strike, and what to reap when a launcher is stopped.

torchrun starts its workers in sessions of their own, so signalling the launcher's process
group leaves them behind; walking the parent links finds them. Linux only (elsewhere the
tree is empty: nothing is ever signalled by mistake).
"""

from __future__ import annotations

import os

__all__ = ["descendants"]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before their children."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
