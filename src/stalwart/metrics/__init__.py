"""Events and metrics: the typed JSONL event log every part writes, and (later) the
goodput/RTO/MTBF figures, reports and exporters derived from it."""

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
