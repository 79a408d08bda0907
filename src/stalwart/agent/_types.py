"""Small Protocols the agent's parts share for their collaborators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.agent.config import LaunchConfig
from stalwart.chaos import FaultLedger
from stalwart.metrics.events import EventLog

__all__ = ["EventSink", "NodeContext", "Say"]


class EventSink(Protocol):
    """The run's event log (stalwart.metrics.EventLog)."""

    def emit(self, kind: str, **fields: Any) -> None: ...


Say = Callable[[str], None]
"""One diagnostic line for the user (stderr)."""


@dataclass(frozen=True)
class NodeContext:
    """What nearly every part of a node's agent is built with."""

    cfg: LaunchConfig
    run_dir: str
    events: EventLog  # the run's event log
    ledger: FaultLedger  # which chaos faults fired, when (detection latencies)
    say: Say
