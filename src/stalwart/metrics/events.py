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

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions this reader reads: 2 added ``probe``, ``preflight``, ``straggler``,
``sdc_check``, ``sdc_detected`` and ``numeric_fault`` (a version-1 log is a version-2 log
without them)."""
EVENTS_FILE = "events.jsonl"

_NUM = (int, float)
_OPT_INT = (int, type(None))
_STR = (str,)
_INT = (int,)
_BOOL = (bool,)
_ANY = (object,)

# kind -> field name -> accepted types. Fields not listed here are rejected.
# Times are seconds (float), sizes bytes (int); "domain" is {"rank": .., "node": ..}.
EVENT_KINDS: dict[str, dict[str, tuple[type, ...]]] = {
    "run_start": {
        "job": _STR,
        "world_size": _INT,
        "nnodes": _INT,
        "strategy": _STR,
        "config": (dict,),
    },
    "run_end": {"status": _STR, "last_step": _OPT_INT, "reason": _STR},
    "member_join": {
        "member": _STR,
        "node": _INT,
        "rank": _OPT_INT,
        "generation": _INT,
        "standby": _BOOL,
    },
    "member_leave": {"member": _STR, "node": _INT, "rank": _OPT_INT, "reason": _STR},
    "generation": {"generation": _INT, "world_size": _INT, "reason": _STR},
    "steps": {
        "first_step": _INT,
        "last_step": _INT,
        "count": _INT,
        "busy_s": _NUM,
        "t_first_start": _NUM,
        "generation": _INT,
        "resume_unknown": _BOOL,
    },
    "snapshot": {"step": _INT, "bytes": _INT, "stall_s": _NUM, "tier": _STR},
    "persist_begin": {"step": _INT},
    "persist_end": {
        "step": _INT,
        "ok": _BOOL,
        "bytes_written": _INT,
        "total_bytes": _INT,
        "seconds": _NUM,
        "error": _STR,
    },
    "fault_injected": {"fault": _STR, "domain": (dict,), "spec": _STR},
    "fault_unfired": {
        "spec": _STR,
        "reason": _STR,
        "domain": (dict,),
        "last_step": _INT,
        "ran_s": _NUM,
    },
    "fault_detected": {"fault": _STR, "domain": (dict,), "latency_s": _NUM, "how": _STR},
    "isolation": {"member": _STR, "reason": _STR, "blocklisted": _BOOL},
    "recovery_begin": {"strategy": _STR, "generation": _INT, "cause": _STR},
    "recovery_end": {
        "strategy": _STR,
        "generation": _INT,
        "restored_step": _OPT_INT,  # None: a plain script resumed where stalwart cannot see
        "source_tier": _STR,
        "steps_lost": _OPT_INT,
        "ok": _BOOL,
    },
    "restore": {
        "step": _INT,
        "tier": _STR,
        "seconds": _NUM,
        "bytes": _INT,
        "preloaded": _BOOL,
        "source_rank": _INT,
    },
    "waiting": {"have": _INT, "need": _INT, "reason": _STR},
    "resize": {
        "world_size": _INT,
        "micro_batches": _INT,
        "lr": _NUM,
        "global_batch": _INT,
        "generation": _INT,
        "from_world_size": _INT,
        "reason": _STR,
        "step": _INT,
        "stall_s": _NUM,
        "transfer_bytes": _INT,
        "transfer_s": _NUM,
    },
    "state_received": {
        "step": _INT,
        "digest": _STR,
        "sender_digest": _STR,
        "bytes": _INT,
        "seconds": _NUM,
        "transfers": _INT,
    },
    "loss": {"step": _INT, "value": _NUM, "generation": _INT},
    "metric": {"name": _STR, "step": _INT, "value": _NUM, "generation": _INT},
    "route": {"route": _STR, "recovery": _STR},
    "note": {"message": _STR},
    "tier_commit": {"tier": _STR, "step": _INT, "seconds": _NUM, "lag_s": _NUM, "bytes": _INT},
    "probe": {
        "probe": _STR,
        "ok": _BOOL,
        "skipped": _BOOL,
        "detail": _STR,
        "value": _NUM,
        "limit": _NUM,
        "unit": _STR,
        "domain": (dict,),
    },
    "preflight": {
        "member": _STR,
        "ok": _BOOL,
        "verdict": _STR,
        "matmul_s": _NUM,
        "allreduce_s": _NUM,
        "partner": _OPT_INT,
        "retest_partner": _OPT_INT,
        "retest_allreduce_s": _NUM,
        "seconds": _NUM,
    },
    "straggler": {
        "domain": (dict,),
        "compute_s": _NUM,
        "median_s": _NUM,
        "ratio": _NUM,
        "score": _NUM,
        "windows": _INT,
        "action": _STR,
        "latency_s": _NUM,
    },
    "sdc_check": {"step": _INT, "digest": _STR, "replicas": _INT},
    "sdc_detected": {
        "step": _INT,
        "detected_step": _INT,
        "ranks": (list,),
        "digests": (list,),
        "verified_step": _INT,
        "action": _STR,
    },
    "numeric_fault": {
        "step": _INT,
        "reason": _STR,
        "ranks": (list,),
        "action": _STR,
        "restored_step": _INT,
        "skipped_step": _INT,
        "data_position": (dict,),
        "value": _NUM,
        "z": _NUM,
    },
    "replica_drop": {"group": _INT, "rank": _INT, "cause": _STR},
    "replica_rejoin": {
        "group": _INT,
        "round": _INT,
        "step": _INT,
        "own_snapshot": _BOOL,
        "bytes": _INT,
        "seconds": _NUM,
    },
    "replica_sync": {
        "round": _INT,
        "step": _INT,
        "members": (list,),
        "dropped": (list,),
        "seconds": _NUM,
    },
}
_REQUIRED: dict[str, set[str]] = {
    "run_start": {"job", "world_size"},
    "run_end": {"status"},
    "member_join": {"member"},
    "member_leave": {"member", "reason"},
    "generation": {"generation", "world_size"},
    "steps": {"first_step", "last_step", "count", "busy_s", "t_first_start"},
    "snapshot": {"step", "stall_s"},
    "persist_begin": {"step"},
    "persist_end": {"step", "ok", "seconds"},
    "fault_injected": {"fault", "domain"},
    "fault_unfired": {"spec", "reason"},
    "fault_detected": {"fault", "domain", "latency_s"},
    "isolation": {"member", "reason"},
    "recovery_begin": {"strategy", "generation"},
    "recovery_end": {"strategy", "generation", "restored_step", "steps_lost"},
    "restore": {"step", "tier", "seconds"},
    "waiting": {"have", "need"},
    "resize": {"world_size"},
    "state_received": {"step", "digest", "sender_digest"},
    "loss": {"step", "value"},
    "metric": {"name", "step", "value"},
    "route": {"route"},
    "note": {"message"},
    "tier_commit": {"tier", "step", "seconds", "lag_s"},
    "probe": {"probe", "ok", "detail"},
    "preflight": {"member", "ok", "verdict"},
    "straggler": {"domain", "compute_s", "median_s", "score", "windows", "action"},
    "sdc_check": {"step", "digest"},
    "sdc_detected": {"step", "detected_step", "ranks", "action"},
    "numeric_fault": {"step", "reason", "ranks", "action"},
    "replica_drop": {"group", "cause"},
    "replica_rejoin": {"group", "round", "step"},
    "replica_sync": {"round", "step", "members", "dropped"},
}
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
    missing = _REQUIRED[kind] - fields.keys()
    if missing:
        raise EventLogError(f"event {kind!r} lacks required field(s) {', '.join(sorted(missing))}")
    for name, value in fields.items():
        types = spec.get(name)
        if types is None:
            raise EventLogError(f"event {kind!r} has no field {name!r}; fields: {', '.join(spec)}")
        if types is not _ANY and (
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
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

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
