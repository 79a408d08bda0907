"""A run directory holds one run's records: a reused ``--run-dir`` is rotated, never merged.

Reusing ``--run-dir`` is how a job is resumed (its persisted checkpoints live in
``RUN_DIR/ckpt``), so refusing a used directory is not an option, and appending to the old
``events.jsonl`` merges two runs into one report (and the old ``chaos/fired-*`` records
would keep the new run's faults from firing). So at its start an agent moves the previous
run's records into ``RUN_DIR/prev/<N>/`` (N = 1, 2, ...: the oldest run has the lowest
number) and keeps in place what a resumed run needs: ``ckpt/`` (the checkpoints it restores
from), ``token`` (other nodes may have been given it) and ``prev/``. Unknown files (a report
the user wrote there) are left alone.

Several agents of one job may share a run directory (nodes on one host): the first one
rotates, the others join it. ``RUN_DIR/run.json`` names the job and the agents using the
directory (pid and process start time, so a reused pid does not count); an agent rotates
only when no agent listed there is alive on this host. A live agent of another job in the
same directory is refused (``ConfigError``: pass another ``--run-dir``). All of it happens
under an exclusive ``flock`` on ``RUN_DIR/.lock``, before the agent writes anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["MARKER", "RECORDS", "claim_run_dir"]

MARKER = "run.json"
RECORDS = ("events.jsonl", "chaos", "logs", "agent.json", MARKER)
"""What belongs to one run (moved aside when the directory is reused)."""
_MARKER_VERSION = 1
_MAX_MARKER_BYTES = 64 * 1024


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # the name may hold spaces
    try:
        return int(fields[19])  # field 22 of stat(5); the name ended field 2
    except (IndexError, ValueError):
        return None


def _read_marker(path: str) -> dict[str, Any] | None:
    """The marker, or None when absent or unreadable (a broken one counts as stale)."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(_MAX_MARKER_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != _MARKER_VERSION:
        return None
    agents = doc.get("agents")
    if not isinstance(agents, list) or not isinstance(doc.get("job"), str):
        return None
    return doc


def _alive(doc: dict[str, Any]) -> list[list[int]]:
    """The agents of ``doc`` still running on this host."""
    if doc.get("host") != socket.gethostname():
        return []
    live = []
    for entry in doc["agents"]:
        if (
            isinstance(entry, list)
            and len(entry) == 2
            and all(type(x) is int and x > 0 for x in entry)
            and _start_time(entry[0]) == entry[1]
        ):
            live.append(entry)
    return live


def _next_slot(prev: str) -> str:
    numbers = [int(n) for n in os.listdir(prev) if n.isascii() and n.isdigit() and len(n) < 10]
    return os.path.join(prev, str(max(numbers, default=0) + 1))


def _rotate(run_dir: str) -> str | None:
    """Move the previous run's records into ``prev/<N>``; its path (None: nothing to move)."""
    present = [name for name in RECORDS if os.path.lexists(os.path.join(run_dir, name))]
    if not present:
        return None
    prev = os.path.join(run_dir, "prev")
    os.makedirs(prev, exist_ok=True)
    dest = _next_slot(prev)
    os.mkdir(dest)
    for name in present:
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def _write_marker(run_dir: str, doc: dict[str, Any]) -> None:
    tmp = os.path.join(run_dir, f".{MARKER}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(run_dir, MARKER))


def claim_run_dir(run_dir: str, job: str) -> str | None:
    """Make ``run_dir`` this agent's run directory for ``job``: rotate a previous run's
    records aside, or join the agents of this job already using it. Returns the directory
    the previous run was moved to (None: nothing was moved)."""
    os.makedirs(run_dir, exist_ok=True)
    me = [os.getpid(), _start_time(os.getpid()) or 0]
    fd = os.open(os.path.join(run_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        marker = _read_marker(os.path.join(run_dir, MARKER))
        live = _alive(marker) if marker is not None else []
        if marker is not None and live:
            if marker["job"] != job:
                raise ConfigError(
                    f"--run-dir {run_dir} is in use by job {marker['job']!r} (agent pid "
                    f"{live[0][0]}); pass another --run-dir"
                )
            marker["agents"] = [*live, me]
            _write_marker(run_dir, marker)
            return None
        moved = _rotate(run_dir)
        doc = {
            "v": _MARKER_VERSION,
            "job": job,
            "host": socket.gethostname(),
            "agents": [me],
            "t": time.time(),
        }
        _write_marker(run_dir, doc)
        return moved
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
