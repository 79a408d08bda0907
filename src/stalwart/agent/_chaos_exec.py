"""The agent's side of chaos: time-keyed rank faults and node faults.

Step-keyed rank faults are fired by the worker itself (see ``stalwart.runtime``); the
agent fires what needs a clock or a whole node. ``slow`` on the agent's side is a duty
cycle of SIGSTOP/SIGCONT (the process runs 1/factor of the time), which slows any
process, plain scripts included, without its cooperation.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from stalwart.agent._elastic import elastic_join
from stalwart.chaos import Fault, FaultPlan
from stalwart.errors import StalwartError

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = ["AgentChaos"]

_PERIOD = 0.1  # duty-cycle period of `slow`


class AgentChaos:
    def __init__(self, agent: Agent, faults: list[Fault]) -> None:
        self.agent = agent
        self.pending = list(faults)
        self.slowing: list[tuple[Fault, int, float]] = []  # fault, pid, fired at
        self._stopped: set[int] = set()
        self._seen: set[str] = set()

    def _due(self, fault: Fault, elapsed: float) -> bool:
        if fault.at_time is not None:
            return elapsed >= fault.at_time
        board = self.agent._board
        assert board is not None and fault.at_step is not None
        return any(
            board.read(w.slot).step >= fault.at_step
            for w in self.agent.workers.values()
            if w.state == "running"
            and (fault.rank is None or fault.kind == "join" or fault.rank == w.rank)
        )

    def poll_requests(self) -> None:
        """Faults queued by `stalwart chaos RUN_DIR ...` for this node's ranks."""
        directory = os.path.join(self.agent.run_dir, "chaos", "requests")
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
        except FileNotFoundError:
            return
        for name in names:
            if name in self._seen:
                continue
            self._seen.add(name)
            try:
                with open(os.path.join(directory, name)) as fh:
                    spec = str(json.load(fh)["spec"])
                plan = FaultPlan.parse(spec)
            except (OSError, ValueError, KeyError, StalwartError) as err:
                print(f"stalwart: chaos request {name} ignored: {err}", file=sys.stderr)
                continue
            base = int(name.split(".")[0])  # unique per request: the ledger key
            node, ranks = self.agent.cfg.node_rank, list(self.agent.workers)
            for fault in plan.faults:
                if fault.node == node or fault.rank in ranks:
                    self.pending.append(replace(fault, id=base + fault.id))

    def tick(self, elapsed: float) -> None:
        for fault in list(self.pending):
            if self._due(fault, elapsed) and self._fire(fault):
                self.pending.remove(fault)
        self._duty_cycle()

    def _emit(self, fault: Fault, rank: int | None) -> None:
        self.agent.events.emit(
            "fault_injected",
            fault=fault.kind if fault.rank is not None else f"node_{fault.kind}",
            domain={"rank": rank, "node": self.agent.cfg.node_rank},
            spec=fault.text,
        )
        print(f"stalwart: chaos: {fault.text}", file=sys.stderr, flush=True)

    def _fire(self, fault: Fault) -> bool:
        agent = self.agent
        if fault.kind == "join":
            return elastic_join(agent, fault)
        if fault.node is not None:
            return self._fire_node(fault)
        assert fault.rank is not None
        w = agent.workers[fault.rank]
        if w.state != "running" or not w.pid:
            return False  # not up yet: try again on the next tick
        if not agent.ledger.claim(fault, rank=w.rank, pid=w.pid):
            return True
        self._emit(fault, w.rank)
        with contextlib.suppress(ProcessLookupError):
            if fault.kind == "kill":
                os.kill(w.pid, signal.SIGKILL)
            elif fault.kind == "hang":
                os.kill(w.pid, signal.SIGSTOP)
            else:
                self.slowing.append((fault, w.pid, time.monotonic()))
        return True

    def _fire_node(self, fault: Fault) -> bool:
        """Node loss: every worker, the zygote and this agent die at once, without a
        goodbye; the other nodes see it as a lease expiry (and closed sockets)."""
        agent = self.agent
        record: dict[str, object] = {
            "kind": fault.kind,
            "node": fault.node,
            "permanent": fault.permanent,
        }
        if not agent.ledger.claim_id(str(fault.id), record):
            return True
        self._emit(fault, None)
        live = [w for w in agent.workers.values() if w.pid and w.state == "running"]
        if fault.kind == "kill":
            for w in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
            for pid in agent.standbys.pids() if agent.standbys is not None else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if agent._zygote is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent._zygote.proc.pid, signal.SIGKILL)
            os._exit(137)
        for w in live:
            if fault.kind == "hang":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGSTOP)
            else:
                self.slowing.append((fault, w.pid, time.monotonic()))
        return True

    def _duty_cycle(self) -> None:
        now = time.monotonic()
        for fault, pid, t0 in list(self.slowing):
            if fault.duration is not None and now - t0 > fault.duration:
                self.slowing.remove((fault, pid, t0))
                self._signal(pid, signal.SIGCONT)
                continue
            running_part = _PERIOD / fault.factor
            stop = (now - t0) % _PERIOD >= running_part
            if stop and pid not in self._stopped:
                self._signal(pid, signal.SIGSTOP)
            elif not stop and pid in self._stopped:
                self._signal(pid, signal.SIGCONT)

    def _signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self._stopped.add(pid)
        else:
            self._stopped.discard(pid)
