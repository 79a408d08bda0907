"""Step-keyed chaos for a plain script (one that never calls ``stalwart.init()``).

The stalwart runtime fires a rank's ``at=step:N`` faults itself, at the start of step N. A
plain script has no step boundary stalwart can see except its optimizer: the zygote watches
``optimizer.step()`` (agent/processes/observe.py), and step N of a plain script is its Nth outermost
``optimizer.step()`` call (a container's step and its optimizers' are one,
agent/processes/_outer_step.py). The fault fires just before that call (the observer's global
optimizer pre-hook calls :meth:`_PlainChaos.before`), so it lands at the same point of
training in every run, as for the runtime; ``slow`` sleeps ``factor - 1`` times the last
step interval before each step of its window. Each fault is claimed in the run's ledger
first, so a restarted worker that counts its steps from 1 again does not fire it twice. It
exists only when the plan has a step-keyed fault for this rank; ``stalwart.init()`` removes
it with the observer.
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["install_plain_chaos"]


class _PlainChaos:
    def __init__(self, faults: list[Any], run_dir: str, rank: int, node: int) -> None:
        from stalwart.chaos import FaultLedger

        self.faults = faults
        self.run_dir = run_dir
        self.rank = rank
        self.node = node
        self.ledger = FaultLedger(run_dir)
        self.slowing: list[tuple[Any, float]] = []  # fault, fired at (monotonic)

    def before(self, step: int, interval: float) -> None:
        for fault in [f for f in self.faults if f.at_step == step]:
            self.faults.remove(fault)
            if self.ledger.claim(fault, rank=self.rank, pid=os.getpid()):
                self._fire(fault)
        now = time.monotonic()
        for fault, t0 in list(self.slowing):
            if fault.slows(step, now - t0):
                time.sleep((fault.factor - 1.0) * interval)
            else:
                self.slowing.remove((fault, t0))

    def _fire(self, fault: Any) -> None:
        from stalwart.chaos.inject import inject

        inject(fault, {"rank": self.rank, "node": self.node}, self._emit, self._slow)

    def _emit(self, kind: str, **fields: Any) -> None:
        """One event, the log closed again before the fault fires (a kill loses nothing)."""
        from stalwart.metrics.events import EVENTS_FILE, EventLog

        path = os.path.join(self.run_dir, EVENTS_FILE)
        with EventLog(path, node=self.node, rank=self.rank) as log:
            log.emit(kind, **fields)

    def _slow(self, fault: Any) -> None:
        self.slowing.append((fault, time.monotonic()))


def install_plain_chaos() -> _PlainChaos | None:
    """This worker's step-keyed chaos faults (``before(step, last interval)`` runs them
    before step ``step``), or None when the plan has none for this rank."""
    from stalwart.chaos import FaultPlan
    from stalwart.contract.env import WorkerEnv

    env = WorkerEnv.from_environ()
    plan_path, run_dir, rank = env.chaos_plan, env.run_dir, env.rank
    if not plan_path or not run_dir or not os.path.exists(plan_path):
        return None
    with open(plan_path) as f:
        plan = FaultPlan.from_json(f.read())
    mine = [f for f in plan.faults if f.rank == rank and f.at_step is not None and f.kind != "join"]
    if not mine:
        return None
    return _PlainChaos(mine, run_dir, rank, env.node_rank)
