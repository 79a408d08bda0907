"""Events and metrics: the typed JSONL event log every part writes, and the figures,
reports and exporters derived from it (docs/goodput.md).

Submodules, imported on demand so that importing the event log stays cheap:
``goodput`` (the bucket accounting), ``incidents``, ``stats``, ``convergence``,
``report`` (the JSON/summary document), ``html`` (the HTML report), ``live``,
``console`` and ``prometheus`` (live figures while a run works).
"""

from __future__ import annotations

from stalwart.metrics.events import (
    EVENT_KINDS,
    EVENTS_FILE,
    SCHEMA_VERSION,
    Event,
    EventLog,
    EventLogError,
    ReadResult,
    read_events,
)

__all__ = [
    "EVENTS_FILE",
    "EVENT_KINDS",
    "SCHEMA_VERSION",
    "Event",
    "EventLog",
    "EventLogError",
    "ReadResult",
    "read_events",
]
