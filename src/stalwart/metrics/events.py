"""The run's event log: one JSONL file per run, appended to by every process.

Everything stalwart reports (goodput, RTO, MTBF, lost work, checkpoint overhead) is
derived from this log alone, so every event is typed and validated when written: a
misspelt field fails in the writer's tests, not months later in a report.

Why JSONL with O_APPEND: each event is one ``write()`` of one line on a file opened with
O_APPEND, so lines from several processes on one host never interleave and a crash
loses at most the line being written (the reader reports a truncated tail as
``partial``). Timestamps are wall-clock (``time.time()``, one clock per host) plus the
writer's host name, so a report can tell which clock an event came from.

The schema (kinds, fields, units) is documented in docs/events.md.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from stalwart.errors import StalwartError
from stalwart.metrics._event_kinds import ANY, EVENT_KINDS, REQUIRED

__all__ = [
    "EVENTS_FILE",
    "EVENT_KINDS",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "Event",
    "EventLog",
    "EventLogError",
    "ReadResult",
    "parse_event",
    "read_events",
]

SCHEMA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
"""Versions this reader reads: 2 added ``probe``, ``preflight``, ``straggler``,
``sdc_check``, ``sdc_detected`` and ``numeric_fault`` (a version-1 log is a version-2 log
without them); 3 added ``link_degraded``, ``link_recovered`` and ``tier_commit``; 4 added
``run_start``'s ``launch_t``."""
EVENTS_FILE = "events.jsonl"

_ENVELOPE = {"v", "t", "kind", "host", "pid", "node", "rank"}


class EventLogError(StalwartError):
    """An event does not match the schema, or a log cannot be read."""


@dataclass(frozen=True)
class Event:
    kind: str
    t: float
    host: str
    pid: int
    node: int | None
    rank: int | None
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def _validate(kind: str, fields: dict[str, Any]) -> None:
    spec = EVENT_KINDS.get(kind)
    if spec is None:
        raise EventLogError(f"unknown event kind {kind!r}; known: {', '.join(sorted(EVENT_KINDS))}")
    missing = REQUIRED[kind] - fields.keys()
    if missing:
        raise EventLogError(f"event {kind!r} lacks required field(s) {', '.join(sorted(missing))}")
    for name, value in fields.items():
        types = spec.get(name)
        if types is None:
            raise EventLogError(f"event {kind!r} has no field {name!r}; fields: {', '.join(spec)}")
        if types is not ANY and (
            not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        ):
            raise EventLogError(
                f"event {kind!r} field {name!r} = {value!r}: expected "
                + " or ".join(t.__name__ for t in types)
            )


class EventLog:
    """Appends validated events to ``path``; safe to share between threads, and several
    processes may append to the same file."""

    def __init__(self, path: str, *, node: int | None = None, rank: int | None = None) -> None:
        self.path = path
        self.node = node
        self.rank = rank
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # 0600: the job's records are its user's (docs/security.md)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None:
        _validate(kind, fields)
        record = {
            "v": SCHEMA_VERSION,
            "t": time.time() if t is None else t,
            "kind": kind,
            "host": self._host,
            "pid": os.getpid(),
            "node": self.node,
            "rank": self.rank if rank is None else rank,
            **fields,
        }
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass
class ReadResult:
    events: list[Event]
    partial: bool  # the log ends in a truncated or unreadable line
    problems: list[str]


def parse_event(line: str | bytes) -> Event:
    """One line of an event log, its version and its kind's fields checked; raises
    ``ValueError``, ``KeyError``, ``TypeError`` or :class:`EventLogError` on a bad line."""
    d = json.loads(line)
    if not isinstance(d, dict):
        raise TypeError(f"an event is a JSON object, not {type(d).__name__}")
    if d.get("v") not in READABLE_VERSIONS:
        raise ValueError(f"schema version {d.get('v')!r}, this reader reads {READABLE_VERSIONS}")
    fields = {k: v for k, v in d.items() if k not in _ENVELOPE}
    _validate(str(d["kind"]), fields)
    return Event(
        str(d["kind"]),
        float(d["t"]),
        str(d.get("host", "")),
        int(d.get("pid", 0)),
        d.get("node"),
        d.get("rank"),
        fields,
    )


def read_events(path: str) -> ReadResult:
    """Every event in ``path`` sorted by time; bad lines are reported, not fatal."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as err:
        raise EventLogError(
            f"{path}: no event log here; pass the run directory of a `stalwart run`"
        ) from err
    events: list[Event] = []
    problems: list[str] = []
    lines = raw.split(b"\n")
    partial = bool(lines and lines[-1])  # no final newline: the writer was cut off
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(parse_event(line))
        except (ValueError, KeyError, TypeError, EventLogError) as err:
            problems.append(f"{path}:{n}: {err}")
            if n == len(lines):
                partial = True
    events.sort(key=lambda e: e.t)
    return ReadResult(events, partial or bool(problems), problems)
