"""Firing a worker-side fault on the process that runs it: one helper for the runtime
(runtime/_faults.py) and a plain script's optimizer hook (agent/_plain_chaos.py), so a
fault kind means the same wherever it fires and its ``fault_injected`` event is the same.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from stalwart.chaos.plan import Fault

__all__ = ["inject"]


def inject(
    fault: Fault,
    domain: dict[str, int],
    emit: Callable[..., object] | None,
    slow: Callable[[Fault], None],
) -> None:
    """Record ``fault`` (a ``fault_injected`` event through ``emit``, when there is a
    log) and fire it on this process: ``kill`` is SIGKILL (a crash), ``hang`` is SIGSTOP
    (the process stops, its heartbeat too), anything else (``slow``) is ``slow(fault)``.
    The caller has claimed it in the ledger first (each fault fires once)."""
    if emit is not None:
        emit("fault_injected", fault=fault.kind, domain=domain, spec=fault.text)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        slow(fault)
