"""The agent's share of the run's step records: what rank 0 could not write itself.

Two cases. A worker running the stalwart runtime writes its own ``steps`` batches; when its
process ends without writing the open one (killed, hung, restarted), the agent writes it
from the process's step journal (metrics/journal.py). A plain script (no
``stalwart.init()``) writes nothing: the agent records rank 0's optimizer steps from the
progress board (agent/processes/observe.py publishes them), so the report of a plain script has its
steps, ETTR and RTO too. A plain script that resumes from its own checkpoint resumes at a
step only it knows: the observer reads it from the optimizer's state at the process's first
step (Adam's ``step``: agent/processes/observe.py), and the steps are numbered from there, so the
steps it redoes count as lost work and no more. Where the optimizer holds no step count
(SGD, or a script that saves only its model), a restarted process's resume step is not
known: its steps are numbered on from the last one recorded and marked ``resume_unknown``,
and the report says the lost work is unknown rather than counting every step before the
fault (or none) as lost. The first process after a restart writes the ``recovery_end`` a
plain script cannot write, so the restart's RTO is measured. The node that runs rank 0 also
says which route the job took (a ``route`` event): the stalwart runtime's, or torchrun's
restart-everything route of a plain script.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from stalwart.agent._types import NodeContext
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.contract.board import Slot
from stalwart.contract.shm_names import SlotNames
from stalwart.metrics.journal import OPEN, read, written

__all__ = ["StepRecords"]

_FLUSH_S = 1.0


class Events(Protocol):
    path: str

    def emit(self, kind: str, **fields: Any) -> None: ...


class Workers(Protocol):
    """What of agent/processes/_workers.py's LocalWorkers the step records read."""

    def get(self, rank: int) -> Worker | None: ...
    def slot(self, w: Worker) -> Slot: ...


class StepRecords:
    def __init__(
        self,
        *,
        names: SlotNames,
        events: Events,
        workers: Workers,
        generation: Callable[[], int],
        strategy: str,
    ) -> None:
        """``generation``: the job's current one; ``strategy``: the ``--strategy``, the
        recovery of a job under the stalwart runtime (a plain script's is restart)."""
        self._names, self._events, self._workers = names, events, workers
        self._generation, self._strategy = generation, strategy
        self.route: str | None = None
        self.pid = 0  # the plain rank-0 process being recorded
        self.processes = 0  # plain rank-0 processes seen (1 + restarts)
        self.base: int | None = 0  # the step that process resumed after (None: unknown)
        self.offset = 0  # added to its board steps (an unknown resume: numbered on)
        self.last_step = 0  # the last step recorded of the processes before it
        self.unknown = False  # its batches are marked resume_unknown
        self.restarted = False  # its recovery_end is not written yet
        self.prev: tuple[int, float] | None = None  # its last step seen, and when
        self.first: tuple[int, float] | None = None  # the first seen, before a duration
        self.batch: dict[str, Any] | None = None
        self.t_last = 0.0
        self.t_spawn = 0.0
        self.last_flush = time.monotonic()

    @classmethod
    def for_node(
        cls,
        ctx: NodeContext,
        names: SlotNames,
        workers: Workers,
        generation: Callable[[], int],
    ) -> StepRecords:
        return cls(
            names=names,
            events=ctx.events,
            workers=workers,
            generation=generation,
            strategy=ctx.cfg.strategy,
        )

    # ------------------------------------------------------------ both routes
    def on_exit(self, pid: int) -> None:
        """A worker process ended: write what it left unwritten."""
        if pid == self.pid:
            self._read_board()
            self.flush()
            self.pid, self.prev, self.first = 0, None, None
        self._from_journal(pid)

    def close(self) -> None:
        """At teardown: journals of processes not seen to exit (the stop timed out)."""
        self.flush()
        for path in self._names.step_journals():
            pid = self._names.journal_pid(path)
            if pid is not None:
                self._from_journal(pid)

    def _from_journal(self, pid: int) -> None:
        path = self._names.step_journal(pid)
        rec = read(path)
        if rec is not None and (rec.state == OPEN or not written(self._events.path, pid, rec)):
            self._events.emit("steps", t=rec.t_end, rank=0, **rec.fields())
        with contextlib.suppress(OSError):
            os.unlink(path)

    # ------------------------------------------------------------ plain scripts
    def tick(self, now: float) -> None:
        """Read rank 0's board slot (the node running rank 0, while it is plain)."""
        if self.route == "stalwart":
            return
        self._read_board()
        if self.batch is not None and time.monotonic() - self.last_flush > _FLUSH_S:
            self.flush()

    def _read_board(self) -> None:
        w = self._workers.get(0)
        if w is None or not w.pid or w.state is not WorkerState.RUNNING:
            return
        slot = self._workers.slot(w)
        if slot.pid != w.pid or not (slot.attached or slot.observed):
            return
        if self.route is None:
            self._say_route("stalwart" if slot.attached else "plain")
        if not slot.observed:
            return
        if w.pid != self.pid:
            self.flush()
            self.pid, self.prev, self.first = w.pid, None, None
            self.t_spawn = w.t_spawn  # no step of this process began before
            self._new_process(slot.resumed)
        self._advance(slot.step + self.offset, slot.t_progress)

    def _new_process(self, resumed: int) -> None:
        """Where a new plain rank-0 process's steps start: the step its optimizer's state
        says it resumed after (``resumed`` - 1), 0 for the run's first process, else not
        known (numbered on from the last step recorded, batches marked)."""
        self.processes += 1
        if resumed >= 1:
            self.base, self.offset, self.unknown = resumed - 1, 0, False
        elif self.processes == 1:
            self.base, self.offset, self.unknown = 0, 0, False
        else:
            self.base, self.offset, self.unknown = None, self.last_step, True
        self.restarted = self.processes > 1

    def _say_route(self, route: str) -> None:
        self.route = route
        self._events.emit(
            "route", route=route, recovery=self._strategy if route == "stalwart" else "restart"
        )

    def _advance(self, step: int, t: float) -> None:
        if step < 1:
            return
        if self.prev is None:
            self.prev = self.first = (step, t)
            return
        ps, pt = self.prev
        if step <= ps or t <= pt:
            return
        self.prev = (step, t)
        self.t_last = t
        if self.batch is None:
            gen = self._generation()
            if self.first is not None:
                # steps after the resume step, to s0, ended by t0: their start from the
                # pace of the next ones
                s0, t0 = self.first
                base = self.offset if self.base is None else self.base
                per = (t - pt) / (step - ps)
                start = max(t0 - per * (s0 - base), self.t_spawn)
                self.batch = {"first_step": base + 1, "t_first_start": start, "generation": gen}
                self.first = None
                if self.restarted:
                    self._recovered(gen, start)
            else:
                self.batch = {"first_step": ps + 1, "t_first_start": pt, "generation": gen}
            if self.unknown:
                self.batch["resume_unknown"] = True
        b = self.batch
        b["last_step"] = step
        self.last_step = max(self.last_step, step)
        b["count"] = step - b["first_step"] + 1
        b["busy_s"] = t - b["t_first_start"]

    def _recovered(self, generation: int, t: float) -> None:
        """The ``recovery_end`` of a restarted plain script, dated ``t``: the start of its
        first step (the recovery ends there: RTO counts to it); the step it resumed at
        and the steps it redoes (None where not known)."""
        self.restarted = False
        lost = None if self.base is None else max(self.last_step - self.base, 0)
        self._events.emit(
            "recovery_end",
            t=t,
            strategy="restart",
            generation=generation,
            restored_step=self.base,
            steps_lost=lost,
            source_tier="script",
        )

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        batch, self.batch = self.batch, None
        if batch is not None:
            self._events.emit("steps", t=self.t_last, rank=0, **batch)
