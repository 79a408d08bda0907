"""Did a run meet its chaos faults? One line per planned fault that never fired.

A faulted run that ended before its faults (a fast machine, a job sized in steps, a fault
planned in seconds) is a fault-free run: a test or a benchmark that reads it as faulted
measures nothing, and passes or fails for a reason it does not state. This reads the
run's event log (docs/events.md): the plan from ``run_start``'s ``config.chaos``, what
fired from ``fault_injected`` (its ``spec`` is the fault's text, a tampering fault's with
what it changed after it), and why a fault did not from the agents' ``fault_unfired``
(written at the end of the run, one per fault aimed at their node). A planned fault with
neither record belongs to a run whose agents did not reach their end (killed, timed out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from stalwart.chaos.plan import FaultPlan
from stalwart.chaos.spec import ChaosSpecError

__all__ = ["unmet_faults"]

_NO_RECORD = (
    "no fault_injected event and no fault_unfired either: the run ended before its agents "
    "could say (killed or timed out?)"
)


def _planned(events: list[tuple[str, Mapping[str, Any]]]) -> list[str]:
    for kind, fields in events:
        if kind != "run_start":
            continue
        config = fields.get("config")
        spec = config.get("chaos") if isinstance(config, Mapping) else None
        if isinstance(spec, str) and spec:
            try:
                return [f.text for f in FaultPlan.parse(spec).faults]
            except ChaosSpecError as err:
                return [f"(the run's chaos spec does not parse: {err})"]
    return []


def unmet_faults(events: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """``"chaos fault 'TEXT' never fired: WHY"`` for each fault of the run's plan (and
    each fault queued later, which only ``fault_unfired`` names) that did not fire, in the
    plan's order; empty when the run met every fault it planned."""
    events = list(events)
    fired = [str(f.get("spec", "")) for k, f in events if k == "fault_injected"]
    why = {str(f["spec"]): str(f["reason"]) for k, f in events if k == "fault_unfired"}
    out = []
    planned = _planned(events)
    for text in planned:
        if any(s == text or s.startswith(text + " (") for s in fired):
            continue
        out.append(f"chaos fault {text!r} never fired: {why.get(text, _NO_RECORD)}")
    out += [f"chaos fault {t!r} never fired: {w}" for t, w in why.items() if t not in planned]
    return out
