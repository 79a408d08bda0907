"""The agent's side of chaos: time-keyed rank faults and node faults.

Step-keyed rank faults are fired by the worker itself (see ``stalwart.runtime``); the
agent fires what needs a clock or a whole node. ``slow`` on the agent's side is a duty
cycle of SIGSTOP/SIGCONT (the process runs 1/factor of the time), which slows any
process, plain scripts included, without its cooperation: in a thread of its own with a
10 ms period, so that every step is slowed alike (agent/processes/_duty.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol

from stalwart.agent._types import EventSink, NodeContext
from stalwart.agent.processes._duty import DutyCycle
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.agent.rundir._private import owned_file
from stalwart.chaos import Fault, FaultLedger, FaultPlan
from stalwart.contract.board import Slot
from stalwart.errors import StalwartError
from stalwart.logs import get_logger

__all__ = ["AgentChaos"]

_log = get_logger(__name__)


class Workers(Protocol):
    """What of agent/processes/_workers.py's LocalWorkers the agent's chaos uses."""

    def __iter__(self) -> Iterator[Worker]: ...
    def get(self, rank: int) -> Worker | None: ...
    def slot(self, w: Worker) -> Slot: ...
    def ranks(self) -> list[int]: ...
    def last_step(self) -> int | None: ...


_REQUEST = re.compile(r"([0-9]{1,20})\.json", re.ASCII)
_MAX_REQUEST_BYTES = 64 * 1024
_MIN_QUEUE_NS = 10**18  # 2001: below it, request ids could collide with the plan's


class AgentChaos:
    def __init__(
        self,
        faults: list[Fault],
        *,
        node: int,
        answerable: list[Fault],
        run_dir: str,
        workers: Workers,
        events: EventSink,
        ledger: FaultLedger,
        join: Callable[[Fault], bool],
        kill_node: Callable[[], None],
    ) -> None:
        """``faults``: this agent fires them; ``answerable``: the faults aimed at this
        node (reported when they never fired); ``join``: fires a ``join`` fault
        (agent/strategies/_elastic.py); ``kill_node``: ends every process of the node."""
        self._node, self._run_dir, self._workers = node, run_dir, workers
        self._events, self._ledger, self._join, self._kill_node = events, ledger, join, kill_node
        self.pending = list(faults)
        self.slowing: list[DutyCycle] = []  # the processes `slow` duty-cycles
        self._seen: set[str] = set()
        # the `time:` origin: the job's first step, as this node's workers report it
        self.first_step: float | None = None
        self._origins: dict[int, float] = {}  # fault id -> origin (queued requests)
        self.answerable = list(answerable)
        self.last_tick: float | None = None  # the clock of the newest tick: the run's end

    def _due(self, fault: Fault, now: float) -> bool:
        if fault.at_time is not None:
            origin = self._origins.get(fault.id, self.first_step)
            return origin is not None and now - origin >= fault.at_time
        assert fault.at_step is not None
        return any(
            self._workers.slot(w).step >= fault.at_step
            for w in self._workers
            if w.state is WorkerState.RUNNING
            and (fault.rank is None or fault.kind == "join" or fault.rank == w.rank)
        )

    def _watch_first_step(self, now: float) -> None:
        if self.first_step is not None:
            return
        for w in self._workers:
            if w.state is not WorkerState.RUNNING or not w.pid:
                continue
            slot = self._workers.slot(w)
            if slot.pid == w.pid and (slot.step >= 1 or slot.phase in ("step", "collective")):
                self.first_step = now
                return

    def poll_requests(self) -> None:
        """Faults queued by `stalwart chaos RUN_DIR ...` for this node's ranks. A request
        that cannot be read (a stray file, bad JSON, a bad spec) is reported once, as a
        line on stderr and a ``note`` event, and skipped: it never ends the agent's loop."""
        directory = os.path.join(self._run_dir, "chaos", "requests")
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
        except OSError:
            return
        for name in names:
            if name in self._seen:
                continue
            self._seen.add(name)
            try:
                base, plan = _read_request(directory, name)
            except (OSError, ValueError, RecursionError, StalwartError) as err:
                why = str(err).splitlines()[0] if str(err) else type(err).__name__
                self._note(f"chaos request {name} ignored: {why}")
                continue
            node, ranks = self._node, self._workers.ranks()
            for fault in plan.faults:
                if fault.node == node or fault.rank in ranks:
                    mine = replace(fault, id=base + fault.id)
                    self._origins[mine.id] = base / 1e9  # at=time: counts from the queueing
                    self.pending.append(mine)
                    self.answerable.append(mine)

    def _note(self, message: str) -> None:
        _log.warning(message)
        with contextlib.suppress(StalwartError, OSError):
            self._events.emit("note", message=message)

    def report_unfired(self) -> list[Fault]:
        """At the end of the run: one warning line and a ``fault_unfired`` event per fault
        aimed at this node that never fired, saying why (a job that ended before its fault,
        on a fast machine, would otherwise pass for a faulted run); returns them."""
        fired = self._ledger.fired()
        last = self._workers.last_step() or 0
        unfired = [f for f in self.answerable if str(f.id) not in fired]
        for fault in unfired:
            origin = self._origins.get(fault.id, self.first_step)
            ran_s = -1.0 if origin is None or self.last_tick is None else self.last_tick - origin
            why = _why_unfired(fault, last, ran_s, queued=fault.id in self._origins)
            if fault.at_step is not None and not any(w.attached for w in self._workers):
                why += " (a plain script's step is its optimizer.step(): did it step one?)"
            _log.warning("chaos fault %r never fired: %s", fault.text, why)
            with contextlib.suppress(StalwartError, OSError):
                self._events.emit(
                    "fault_unfired",
                    spec=fault.text,
                    reason=why,
                    domain=fault.domain,
                    last_step=last,
                    ran_s=round(ran_s, 3),
                )
        return unfired

    @classmethod
    def for_node(
        cls,
        ctx: NodeContext,
        plan: FaultPlan,
        workers: Workers,
        *,
        join: Callable[[Fault], bool],
        kill_node: Callable[[], None],
    ) -> AgentChaos:
        """The agent-side faults of ``plan`` for this node."""
        node, nproc = ctx.cfg.node_rank, ctx.cfg.nproc_per_node
        return cls(
            plan.agent_faults(node, workers.ranks()),
            node=node,
            answerable=plan.home_faults(node, nproc),
            run_dir=ctx.run_dir,
            workers=workers,
            events=ctx.events,
            ledger=ctx.ledger,
            join=join,
            kill_node=kill_node,
        )

    def slowed(self) -> frozenset[int]:
        """Pids this agent duty-cycles with SIGSTOP/SIGCONT (``slow``): not hung."""
        return frozenset(cycle.pid for cycle in self.slowing)

    def pending_faults(self) -> list[Fault]:
        return list(self.pending)

    def tick(self, now: float) -> None:
        """Fire what is due at wall-clock ``now``."""
        self.last_tick = now
        self._watch_first_step(now)
        for fault in list(self.pending):
            if self._due(fault, now) and self._fire(fault):
                self.pending.remove(fault)
        self.slowing = [cycle for cycle in self.slowing if cycle.active()]

    def close(self) -> None:
        """End every duty cycle and leave its process running."""
        for cycle in self.slowing:
            cycle.close()
        self.slowing = []

    def _emit(self, fault: Fault, rank: int | None) -> None:
        self._events.emit(
            "fault_injected",
            fault=fault.kind if fault.rank is not None else f"node_{fault.kind}",
            domain={"rank": rank, "node": self._node},
            spec=fault.text,
        )
        _log.info("chaos: %s", fault.text)

    def _fire(self, fault: Fault) -> bool:
        if fault.kind == "join":
            return self._join(fault)
        if fault.node is not None:
            return self._fire_node(fault)
        assert fault.rank is not None
        w = self._workers.get(fault.rank)
        assert w is not None
        if w.state is not WorkerState.RUNNING or not w.pid:
            return False  # not up yet: try again on the next tick
        if not self._ledger.claim(fault, rank=w.rank, pid=w.pid):
            return True
        self._emit(fault, w.rank)
        with contextlib.suppress(ProcessLookupError):
            if fault.kind == "kill":
                os.kill(w.pid, signal.SIGKILL)
            elif fault.kind == "hang":
                os.kill(w.pid, signal.SIGSTOP)
            else:
                self.slowing.append(DutyCycle(w.pid, fault.factor, fault.duration))
        return True

    def _fire_node(self, fault: Fault) -> bool:
        """Node loss: every worker, the zygote and this agent die at once, without a
        goodbye; the other nodes see it as a lease expiry (and closed sockets)."""
        record: dict[str, object] = {
            "kind": fault.kind,
            "node": fault.node,
            "permanent": fault.permanent,
        }
        if not self._ledger.claim_id(str(fault.id), record):
            return True
        self._emit(fault, None)
        live = [w for w in self._workers if w.pid and w.state is WorkerState.RUNNING]
        if fault.kind == "kill":
            self._kill_node()
            os._exit(137)
        for w in live:
            if fault.kind == "hang":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGSTOP)
            else:
                self.slowing.append(DutyCycle(w.pid, fault.factor, fault.duration))
        return True


def _why_unfired(fault: Fault, last_step: int, ran_s: float, *, queued: bool) -> str:
    """Why ``fault`` never fired, in one clause: the job ended first, and how far it got
    (the step it reached, or the seconds it ran from the fault's time origin)."""
    if fault.at_step is not None:
        return f"the job ended at step {last_step} before step {fault.at_step}"
    assert fault.at_time is not None
    due = f"{fault.at_time:g} s"
    if ran_s < 0:
        return "no worker of its node ever reported a step (at=time: counts from the first)"
    since = "it was queued" if queued else "the first step"
    return f"the job ended first, {ran_s:.1f} s after {since}, before the fault's {due}"


def _read_request(directory: str, name: str) -> tuple[int, FaultPlan]:
    """One request file: ``<ns>.json`` holding ``{"spec": "..."}``; (ns, plan)."""
    m = _REQUEST.fullmatch(name)
    if m is None or int(m.group(1)) < _MIN_QUEUE_NS:
        raise ValueError("not a request name (<queue time in ns>.json)")
    path = os.path.join(directory, name)
    distrust = owned_file(path)  # only the job's user may queue a fault
    if distrust is not None:
        raise ValueError(f"refused: {distrust}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(_MAX_REQUEST_BYTES + 1)
    if len(raw) > _MAX_REQUEST_BYTES:
        raise ValueError("over 64 KiB")
    doc = json.loads(raw.decode("utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), str):
        raise ValueError('expected {"spec": "FAULT ..."}')
    return int(m.group(1)), FaultPlan.parse(doc["spec"])
