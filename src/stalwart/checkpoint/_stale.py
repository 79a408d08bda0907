"""Who owns a run's /dev/shm names on this host, and the startup sweep of dead runs'.

Why: a SIGKILLed agent runs no teardown, so its run's slots (the snapshots: often the
model and optimizer, gigabytes) stay in ``/dev/shm`` until the host reboots; no later run
would ever use them (a new run draws a new run id). The names alone cannot tell a dead
run from a live one: another job of this user, or another node of the same run on this
host, may use them right now.

So each agent, once its run's names are agreed, writes an **owner record**
(``stalwart-<job>-<run>-owner-<pid>``: 0600, ``O_EXCL``, privfile.py) holding its pid,
that process's start time (``/proc/<pid>/stat`` field 22: a pid reused by a later
process has another), the boot id and its pid namespace; it removes the record when it
ends. At start, after writing its own, the agent sweeps: a run's names are removed when
every owner record of that run on this host names a process that is gone. Never
removed: names of a run with any live owner (another job, another node of this run, a
replacement agent of this run that restores from them), names no owner record covers
(torchrun, plain python, an older stalwart), anything of another user (only entries
this user owns are touched, and only this user's records count), and names whose
owner lives in another pid namespace (its liveness cannot be judged from here) or whose
record cannot be read. docs/security.md states the model; docs/checkpoint-format.md
lists the record among the names in /dev/shm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass

from stalwart.privfile import open_own

__all__ = ["OwnerRecord", "sweep_stale"]

_VERSION = 1
_RECORD_RE = re.compile(r"^stalwart-(?P<stem>.+)-owner-(?P<pid>[0-9]+)$")
_MAX_RECORD_BYTES = 4096


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # the name may hold spaces
    try:
        return int(fields[19])  # field 22 of stat(5); the name ended field 2
    except (IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class OwnerRecord:
    """This process's claim on a run's /dev/shm names (``stem``: ``<job>-<run>``)."""

    shm_dir: str
    stem: str

    @property
    def path(self) -> str:
        return os.path.join(self.shm_dir, f"stalwart-{self.stem}-owner-{os.getpid()}")

    def write(self) -> None:
        """Write the record (0600, never through a link; this process's own again after
        a restart in the same process is replaced)."""
        pid = os.getpid()
        doc = {
            "v": _VERSION,
            "stem": self.stem,
            "pid": pid,
            "start": _start_time(pid),
            "boot": _boot_id(),
            "pidns": _pid_ns(),
        }
        fd = open_own(self.path, create=True)
        with os.fdopen(fd, "w") as f:
            f.truncate()
            json.dump(doc, f)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def others_alive(self) -> bool:
        """Whether another process of this run on this host (another node's agent) may
        still live: True too where a record of it cannot be judged."""
        own = os.path.basename(self.path)
        for name in _listdir(self.shm_dir):
            rec = _read_record(self.shm_dir, name) if name != own else None
            if rec is not None and rec[0] == self.stem and rec[1]:
                return True
        return False


def _read_record(shm_dir: str, name: str) -> tuple[str, bool] | None:
    """(stem, alive) of an owner record of this user's; None: not one (or unreadable,
    which counts as no judgement: its names are kept)."""
    m = _RECORD_RE.match(name)
    if m is None:
        return None
    path = os.path.join(shm_dir, name)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(_MAX_RECORD_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return m["stem"], True
    return m["stem"], _alive(doc, m["stem"], int(m["pid"]))


def _alive(doc: object, stem: str, pid: int) -> bool:
    """Whether the record's owner may still live (True whenever it cannot be judged)."""
    if not isinstance(doc, dict) or doc.get("v") != _VERSION:
        return True
    if doc.get("stem") != stem or doc.get("pid") != pid:
        return True  # a record not matching its own name: not ours to judge
    if doc.get("boot") != _boot_id():
        return False  # the host rebooted since (a /dev/shm that survived it)
    if doc.get("pidns") != _pid_ns():
        return True  # another pid namespace: its pid means nothing here
    now = _start_time(pid)
    if now is None:
        return False  # no such process
    start = doc.get("start")
    return start is None or now == start  # (None: the writer could not read its own)


def _owners(shm_dir: str, names: list[str]) -> dict[str, bool]:
    """stem -> whether any owner of that run on this host may be alive."""
    out: dict[str, bool] = {}
    for name in names:
        rec = _read_record(shm_dir, name)
        if rec is not None:
            out[rec[0]] = out.get(rec[0], False) or rec[1]
    return out


def _listdir(shm_dir: str) -> list[str]:
    try:
        return [n for n in os.listdir(shm_dir) if n.startswith("stalwart-")]
    except OSError:
        return []


def _remove(path: str) -> bool:
    """Remove ``path`` when it is this user's (a directory with what is in it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid != os.getuid():
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def sweep_stale(shm_dir: str) -> list[str]:
    """Remove the /dev/shm names of this user's runs whose every owner on this host is
    gone; returns what was removed. Each entry belongs to the longest run stem it starts
    with (``stalwart-<stem>-``); an entry of no recorded run is kept. A run's owner
    records go last, and its owners are read again just before its names go (an agent
    of that run starting meanwhile keeps them)."""
    names = _listdir(shm_dir)
    owners = _owners(shm_dir, names)
    stems = sorted(owners, key=len, reverse=True)
    by_stem: dict[str, list[str]] = {}
    for name in names:
        stem = next((s for s in stems if name.startswith(f"stalwart-{s}-")), None)
        if stem is not None and not owners[stem]:
            by_stem.setdefault(stem, []).append(name)
    removed: list[str] = []
    for stem, entries in by_stem.items():
        if _owners(shm_dir, _listdir(shm_dir)).get(stem, False):
            continue
        # records last: a sweep cut short finds the rest on the next start
        entries.sort(key=lambda n: _RECORD_RE.match(n) is not None)
        for name in entries:
            path = os.path.join(shm_dir, name)
            if _remove(path):
                removed.append(path)
    return removed
