"""Chaos: fault injection by spec (kill, hang, slow, node loss).

``parse_spec`` turns ``"kill rank=2 at=step:50; hang node=1 at=time:40s"`` into a
:class:`FaultPlan`; who executes a fault depends on its trigger: a worker fires its own
step-keyed faults at the exact step boundary (deterministic), the node agent fires
time-keyed faults and node faults. A :class:`FaultLedger` makes every fault fire once,
even when a restarted worker replays the step it was keyed on. :func:`unmet_faults` reads
a run's events for the planned faults that never fired (and why), so that a run that ended
before its faults is not taken for a faulted one.
"""

from __future__ import annotations

from stalwart.chaos.outcome import unmet_faults
from stalwart.chaos.plan import Fault, FaultLedger, FaultPlan
from stalwart.chaos.spec import FAULT_KINDS, ChaosSpecError, parse_spec

__all__ = [
    "FAULT_KINDS",
    "ChaosSpecError",
    "Fault",
    "FaultLedger",
    "FaultPlan",
    "parse_spec",
    "unmet_faults",
]
