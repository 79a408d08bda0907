"""The worker's side of chaos: step-keyed faults fired by the worker itself.

Time-keyed and node faults are fired by the agent (agent/processes/_chaos.py); a fault keyed
by a step can only be fired exactly at that step from inside the training loop. Each
fault is claimed in the run's ledger first, so a replacement worker that replays the
step does not fire it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.chaos.inject import inject

if TYPE_CHECKING:
    from stalwart.chaos import Fault
    from stalwart.contract.env import WorkerEnv
    from stalwart.metrics.events import EventLog

__all__ = ["WorkerFaults"]


class WorkerFaults:
    """The run's fault plan as this worker sees it, and the ledger that fires each
    fault once across the worker's replacements."""

    def __init__(
        self,
        env: WorkerEnv,
        events: EventLog | None,
        slow: Callable[[Fault], None],
        tamper: Callable[[Fault, int], str] | None = None,
    ) -> None:
        self.member = env.rank  # chaos names members by their launch rank (elastic renumbers)
        self.node = env.node_rank
        self.plan = FaultPlan()
        self.ledger: FaultLedger | None = None
        if env.chaos_plan and os.path.exists(env.chaos_plan):
            with open(env.chaos_plan) as f:
                self.plan = FaultPlan.from_json(f.read())
            self.ledger = FaultLedger(env.run_dir)
        self._events = events
        self._slow = slow
        self._tamper = tamper  # corrupt / nan: the integrity checks' live state

    def fire(self, step: int) -> None:
        """Fire the faults planned for this worker at ``step`` (kill, hang, slow, and
        corrupt or nan on the tracked state)."""
        member = self.member
        raw = self._tamper
        tamper = None if raw is None else (lambda f: raw(f, step))
        for fault in self.plan.worker_faults(member, step):
            claimed = self.ledger is not None and self.ledger.claim(
                fault, rank=member, pid=os.getpid()
            )
            # nan is a bad batch: it fires each time step S is run, replays included
            if not claimed and not (fault.kind == "nan" and self.ledger is not None):
                continue
            emit = None if self._events is None else self._events.emit
            inject(fault, {"rank": member, "node": self.node}, emit, self._slow, tamper)
