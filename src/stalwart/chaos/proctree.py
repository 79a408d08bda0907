"""The processes below a launcher, read from /proc: whom a fault sent from outside the
job may strike, and what to reap when a launcher is stopped.

torchrun starts its workers in sessions of their own, so signalling the launcher's process
group leaves them behind; walking the parent links finds them. Linux only (elsewhere the
tree is empty: nothing is ever signalled by mistake).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
from typing import Any

__all__ = ["descendants", "die_with_parent", "stop_tree"]

_PR_SET_PDEATHSIG = 1


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


def die_with_parent() -> None:
    """A ``preexec_fn``: in the child, before exec, ask Linux for SIGTERM when the parent
    dies, even by SIGKILL (PR_SET_PDEATHSIG), so a launcher never outlives whoever
    started it. Elsewhere (no prctl) it does nothing."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _groups(pids: list[int]) -> set[int]:
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            out.add(os.getpgid(pid))
    out.discard(os.getpgrp())  # never our own group
    return out


def _send(groups: set[int], pids: list[int], sig: int) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_tree(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> int:
    """Stop ``proc`` (started in a session of its own) and everything below it: SIGTERM to
    every process group of the tree (torchrun's workers sit in sessions of their own),
    ``grace_s`` for the launcher to stop its own, then SIGKILL to every process and group
    of the tree that is left; returns the launcher's exit status."""
    tree = [proc.pid, *descendants(proc.pid)]
    groups = _groups(tree)
    _send(groups, [] if proc.poll() is not None else [proc.pid], signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    if proc.poll() is None:  # still up: what it started meanwhile counts too
        tree += [p for p in descendants(proc.pid) if p not in tree]
        groups |= _groups(tree)
    _send(groups, tree[1:] if proc.poll() is not None else tree, signal.SIGKILL)
    return proc.wait()
