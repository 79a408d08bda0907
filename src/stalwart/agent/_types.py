"""Small Protocols the agent's parts share for their collaborators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["EventSink", "Say"]


class EventSink(Protocol):
    """The run's event log (stalwart.metrics.EventLog)."""

    def emit(self, kind: str, **fields: Any) -> None: ...


Say = Callable[[str], None]
"""One diagnostic line for the user (stderr)."""
