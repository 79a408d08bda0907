"""Firing a worker-side fault on the process that runs it: one helper for the runtime
(runtime/steps/_faults.py) and a plain script's optimizer hook
(agent/processes/_plain_chaos.py), so a fault kind means the same wherever it fires and
its ``fault_injected`` event is the same.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from stalwart.chaos.plan import Fault

__all__ = ["TAMPER_KINDS", "inject"]

TAMPER_KINDS = ("corrupt", "nan")
"""The kinds that change the tracked state's values instead of the process."""


def inject(
    fault: Fault,
    domain: dict[str, int],
    emit: Callable[..., object] | None,
    slow: Callable[[Fault], None],
    tamper: Callable[[Fault], str] | None = None,
) -> None:
    """Record ``fault`` (a ``fault_injected`` event through ``emit``, when there is a
    log) and fire it on this process: ``kill`` is SIGKILL (a crash), ``hang`` is SIGSTOP
    (the process stops, its heartbeat too), ``slow`` is ``slow(fault)``, ``corrupt`` and
    ``nan`` are ``tamper(fault)`` on the tracked state (runtime/integrity/_checks.py), fired
    before the event so that it says what was changed. The caller has claimed it in the
    ledger first (each fault fires once; ``nan``, a bad batch, at every run of its step).
    """
    spec = fault.text
    if fault.kind in TAMPER_KINDS:
        # a plain script's state is not tracked: nothing to flip, and the event says so
        done = "not fired: no tracked state" if tamper is None else tamper(fault)
        spec = f"{spec} ({done})"
    if emit is not None:
        emit("fault_injected", fault=fault.kind, domain=domain, spec=spec)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind not in TAMPER_KINDS:
        slow(fault)
