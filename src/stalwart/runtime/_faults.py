"""The worker's side of chaos: step-keyed faults fired by the worker itself.

Time-keyed and node faults are fired by the agent (agent/_chaos_exec.py); a fault keyed
by a step can only be fired exactly at that step from inside the training loop. Each
fault is claimed in the run's ledger first, so a replacement worker that replays the
step does not fire it again.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.runtime.session import Session

__all__ = ["fire_worker_faults"]


def fire_worker_faults(sess: Session, step: int) -> None:
    """Fire the faults planned for this worker at ``step`` (kill, hang or slow)."""
    member = sess.env.rank  # chaos names members by their launch rank (elastic renumbers)
    for fault in sess.plan.worker_faults(member, step):
        if sess.ledger is None or not sess.ledger.claim(fault, rank=member, pid=os.getpid()):
            continue
        if sess.events is not None:
            sess.events.emit(
                "fault_injected",
                fault=fault.kind,
                domain={"rank": member, "node": sess.env.node_rank},
                spec=fault.text,
            )
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            sess.acct.slow(fault)
