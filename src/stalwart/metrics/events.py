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
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from stalwart.errors import StalwartError
from stalwart.metrics._event_kinds import ANY, EVENT_KINDS, REQUIRED
from stalwart.userfile import NotRegularFileError, open_regular

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
    problems: list[str]  # the first MAX_PROBLEMS bad lines, then one line with the count
    bad_lines: int = 0  # every line skipped as unreadable
    loss_stride: int = 1  # 1: every loss event kept; k: every k-th (LOSS_CAP)


MAX_LINE = 1 << 20
"""Longest line read (bytes); a longer one is skipped as bad without being held whole."""
MAX_PROBLEMS = 20
"""Bad lines described one by one in ``problems``; the rest are counted."""
LOSS_CAP = 100_000
"""Most ``loss`` events held: past it, every other one kept is dropped (the stride
doubles), so a log of millions of loss lines is read in bounded memory."""


_INT_BOUND = 1 << 63
_T_BOUND = 1e11
"""An event time (Unix seconds) past this is no time a run had (year 5138): a line with
one is skipped, not let through to overflow the report's time axis (1e308 / a column)."""


def _int_or_none(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise TypeError(f"envelope field {key!r} = {v!r}: expected an integer or null")
    if v is not None and not -_INT_BOUND < v < _INT_BOUND:
        raise ValueError(f"envelope field {key!r}: integer out of range (2^63)")
    return v


def parse_event(line: str | bytes) -> Event:
    """One line of an event log, its envelope, version and kind's fields checked; raises
    ``ValueError``, ``KeyError``, ``TypeError``, ``OverflowError``, ``RecursionError`` or
    :class:`EventLogError` on a bad line."""
    d = json.loads(line)
    if not isinstance(d, dict):
        raise TypeError(f"an event is a JSON object, not {type(d).__name__}")
    if d.get("v") not in READABLE_VERSIONS:
        raise ValueError(f"schema version {d.get('v')!r}, this reader reads {READABLE_VERSIONS}")
    kind, t = d["kind"], d["t"]
    if not isinstance(kind, str):
        raise TypeError(f"event kind {kind!r}: expected a string")
    if isinstance(t, bool) or not isinstance(t, int | float) or not abs(float(t)) < _T_BOUND:
        raise ValueError(f"event time {t!r}: expected Unix seconds (a finite number < 1e11)")
    host = d.get("host", "")
    if not isinstance(host, str):
        raise TypeError(f"envelope field 'host' = {host!r}: expected a string")
    fields = {k: v for k, v in d.items() if k not in _ENVELOPE}
    _validate(kind, fields)
    for name, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"event {kind!r} field {name!r} = {value!r}: not a finite number")
        if isinstance(value, int) and not -_INT_BOUND < value < _INT_BOUND:
            raise ValueError(f"event {kind!r} field {name!r}: integer out of range (2^63)")
    return Event(
        kind,
        float(t),
        host,
        _int_or_none(d, "pid") or 0,
        _int_or_none(d, "node"),
        _int_or_none(d, "rank"),
        fields,
    )


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, bool]]:
    """The file's lines, each at most MAX_LINE bytes (a longer one is read past in
    pieces and given as empty with ``whole`` False); ``whole`` is False for an unended
    last line too."""
    while True:
        line = f.readline(MAX_LINE)
        if not line:
            return
        if line.endswith(b"\n"):
            yield line, True
            continue
        if len(line) < MAX_LINE:  # EOF without a newline
            yield line, False
            return
        while line and not line.endswith(b"\n"):  # over-long: skip to its end
            line = f.readline(MAX_LINE)
        yield b"", False


_LOG_FIX = "pass a run directory or its events.jsonl"


def read_events(path: str) -> ReadResult:
    """Every event in ``path`` sorted by time, read as a stream; bad lines are skipped and
    counted (the first MAX_PROBLEMS described), never fatal; past LOSS_CAP loss events the
    loss series is thinned (``loss_stride``)."""
    try:
        f = open_regular(path, what="the event log", fix=_LOG_FIX)
    except NotRegularFileError as err:
        raise EventLogError(str(err)) from err
    except FileNotFoundError as err:
        raise EventLogError(
            f"{path}: no event log here; pass the run directory of a `stalwart run`"
        ) from err
    except OSError as err:
        raise EventLogError(f"{path}: cannot read the event log: {err.strerror or err}") from err
    events: list[Event] = []
    losses: list[tuple[int, Event]] = []
    n_loss, stride = 0, 1
    problems: list[str] = []
    bad, partial = 0, False
    with f:
        for n, (line, whole) in enumerate(_lines(f), 1):
            if whole and not line.strip():
                continue
            try:
                if not line:
                    raise ValueError(f"line longer than {MAX_LINE} bytes")
                ev = parse_event(line)
            except (
                ValueError,
                KeyError,
                TypeError,
                ArithmeticError,
                RecursionError,
                EventLogError,
            ) as err:
                bad += 1
                if bad <= MAX_PROBLEMS:
                    problems.append(f"{path}:{n}: {str(err)[:200]}")
                partial = partial or not whole
                continue
            partial = partial or not whole  # no final newline: the writer was cut off
            if ev.kind != "loss":
                events.append(ev)
                continue
            if n_loss % stride == 0:
                losses.append((n_loss, ev))
                if len(losses) > LOSS_CAP:
                    stride *= 2
                    losses = [(i, e) for i, e in losses if i % stride == 0]
            n_loss += 1
    if bad > MAX_PROBLEMS:
        problems.append(f"{path}: {bad} bad lines skipped in all ({MAX_PROBLEMS} shown)")
    events.extend(e for _, e in losses)
    events.sort(key=lambda e: e.t)
    return ReadResult(events, partial or bad > 0, problems, bad, stride)
