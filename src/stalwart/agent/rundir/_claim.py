"""A run directory holds one run's records: a reused ``--run-dir`` is rotated, never merged.

Reusing ``--run-dir`` is how a job is resumed (its persisted checkpoints live in
``RUN_DIR/ckpt``), so refusing a used directory is not an option, and appending to the old
``events.jsonl`` merges two runs into one report (and the old ``chaos/fired-*`` records
would keep the new run's faults from firing). So at its start an agent moves the previous
run's records into ``RUN_DIR/prev/<N>/`` (N = 1, 2, ...: the oldest run has the lowest
number) and keeps in place what a resumed run needs: ``ckpt/`` (the checkpoints it restores
from), ``token`` (other nodes may have been given it) and ``prev/``. Unknown files (a report
the user wrote there) are left alone.

Several agents of one job share a run directory (nodes on one host, or on several hosts
over a shared filesystem, as docs/launch.md asks): the first one rotates, the others join
it, and nothing is moved while any agent of the run is alive, on any host. Liveness is a
lock, not a pid: every agent holds a shared ``flock`` on ``RUN_DIR/.running`` for its
whole life (the kernel drops it when the process ends, even by SIGKILL), and a starting
agent rotates only when it can take that lock exclusively. A pid and a host name cannot
say whether an agent on another host lives (issue 25: the second host's agent took the
first host's live records for a previous run and moved them to ``prev/1``). The shared
filesystem must support ``flock`` across its clients (NFS v4 does; Lustre with
``-o flock``), as the claim's own ``RUN_DIR/.lock`` already needs. ``RUN_DIR/run.json``
names the job and the agents that joined (pid, process start time, host); a live agent
of another job in the same directory is refused (``ConfigError``: pass another
``--run-dir``). All of it happens under an exclusive ``flock`` on ``RUN_DIR/.lock``,
before the agent writes anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Any

from stalwart.agent.rundir._private import DIR_MODE, FILE_MODE, make_private_dir
from stalwart.errors import ConfigError

__all__ = ["MARKER", "RECORDS", "claim_run_dir"]

MARKER = "run.json"
RECORDS = ("events.jsonl", "chaos", "logs", "agent.json", MARKER)
"""What belongs to one run (moved aside when the directory is reused)."""
_MARKER_VERSION = 2
_RUNNING = ".running"
_held: dict[str, int] = {}
"""run dir -> the descriptor holding this process's shared lock on its ``.running`` (for
the process's life: the lock is the agent's liveness, seen from every host)."""
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
    if not isinstance(agents, list) or len(agents) > 4096 or not isinstance(doc.get("job"), str):
        return None
    return doc


def _entry(doc: dict[str, Any]) -> str:
    """One agent of the marker, for a message (``pid N on HOST``)."""
    agents = doc["agents"]
    last = agents[-1] if agents and isinstance(agents[-1], list) else []
    pid = last[0] if last else "?"
    host = last[2] if len(last) > 2 else "?"
    return f"pid {pid} on {host}"


def _someone_alive(run_dir: str) -> bool:
    """Whether any agent of the run using ``run_dir`` is alive, on any host: it holds a
    shared lock on ``.running`` (this process's own claim is given up first: a new claim
    replaces it). On False, this process holds ``.running`` exclusively."""
    old = _held.pop(run_dir, None)
    if old is not None:
        with contextlib.suppress(OSError):
            os.close(old)
    fd = os.open(os.path.join(run_dir, _RUNNING), os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _held[run_dir] = fd
        return True
    _held[run_dir] = fd
    return False


def _hold(run_dir: str) -> None:
    """Keep this agent's shared lock on ``.running`` for its life."""
    fcntl.flock(_held[run_dir], fcntl.LOCK_SH)


def _next_slot(prev: str) -> str:
    numbers = [int(n) for n in os.listdir(prev) if n.isascii() and n.isdigit() and len(n) < 10]
    return os.path.join(prev, str(max(numbers, default=0) + 1))


def _rotate(run_dir: str) -> str | None:
    """Move the previous run's records into ``prev/<N>``; its path (None: nothing to move)."""
    present = [name for name in RECORDS if os.path.lexists(os.path.join(run_dir, name))]
    if not present:
        return None
    prev = os.path.join(run_dir, "prev")
    os.makedirs(prev, mode=DIR_MODE, exist_ok=True)  # 0700 whatever the umask
    dest = _next_slot(prev)
    os.mkdir(dest, DIR_MODE)
    for name in present:
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def _write_marker(run_dir: str, doc: dict[str, Any]) -> None:
    tmp = os.path.join(run_dir, f".{MARKER}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(run_dir, MARKER))


def claim_run_dir(run_dir: str, job: str) -> str | None:
    """Make ``run_dir`` this agent's run directory for ``job``: rotate a previous run's
    records aside, or join the agents of this job already using it. Returns the directory
    the previous run was moved to (None: nothing was moved)."""
    make_private_dir(run_dir)  # 0700, this user's, writable by no one else
    me = [os.getpid(), _start_time(os.getpid()) or 0, socket.gethostname()]
    fd = os.open(os.path.join(run_dir, ".lock"), os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        marker = _read_marker(os.path.join(run_dir, MARKER))
        alive = _someone_alive(run_dir)
        if marker is not None and alive:
            if marker["job"] != job:
                os.close(_held.pop(run_dir))  # another job's directory: not ours
                raise ConfigError(
                    f"--run-dir {run_dir} is in use by job {marker['job']!r} (agent "
                    f"{_entry(marker)}); pass another --run-dir"
                )
            marker["agents"] = [*marker["agents"], me]
            _write_marker(run_dir, marker)
            _hold(run_dir)
            return None
        moved = None if alive else _rotate(run_dir)
        doc = {"v": _MARKER_VERSION, "job": job, "agents": [me], "t": time.time()}
        _write_marker(run_dir, doc)
        _hold(run_dir)
        return moved
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
