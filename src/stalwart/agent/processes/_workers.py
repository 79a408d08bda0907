"""The node's worker processes: one owner for every worker, spare and pending spawn.

:class:`LocalWorkers` is the only writer of a :class:`Worker`'s process fields (pid,
state, cause, spawn time); everyone else asks it. It also owns the two channels to those
processes, the zygote client (which forks every worker) and the progress board (which
each worker writes at every step), so nothing else clears a slot or sends a fork order.

A worker's life is the state machine below; each transition has one owner (the method
named on it), so that reading ``state`` answers "what may happen to it next"::

    STARTING --spawned (on_message)--> RUNNING --exit rc 0 (on_message)--> DONE
       |                                  |
       +------ exit rc != 0 (on_message) -+--> DEAD --spawn()--> STARTING
                                               |
                                               +--retire()--> GONE (left the job for good)

``spawn()`` also starts a GONE worker again (elastic ``join``); a claimed standby enters
as RUNNING (``adopt(..., pid=...)``). ``cause`` says why the agent itself ended a
process (a hang, a restart, the shutdown): such an exit is not a new failure.

Exits reach the agent as typed :class:`ProcessExit` events; the agent's detectors turn
the failures among them into incidents (agent/detection/incidents.py). This follows
torch.distributed.elastic's ``WorkerState``, but per worker: a stalwart node recovers
one rank in place while the others keep running.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.contract.board import ProgressBoard, Slot
from stalwart.contract.env import WorkerFields

__all__ = ["EXIT_HANG", "LocalWorkers", "ProcessExit", "ProcessWatcher", "Worker", "WorkerState"]

EXIT_HANG = "exit-hang"
"""The cause the agent gives a rank it ended for hanging at exit (after another rank
finished the job, agent/detection/_finished.py): its end is a finish."""


class WorkerState(enum.Enum):
    STARTING = "starting"  # a fork was ordered; no pid yet (or an assigned spare's)
    RUNNING = "running"  # its process runs
    DONE = "done"  # exited 0: its work is over
    DEAD = "dead"  # exited otherwise (a failure, or ended by the agent)
    GONE = "gone"  # left the job for good (elastic); only a join starts it again

    @property
    def live(self) -> bool:
        return self in (WorkerState.STARTING, WorkerState.RUNNING)

    @property
    def ended(self) -> bool:
        return self in (WorkerState.DONE, WorkerState.DEAD)


@dataclass
class Worker:
    """One rank this agent runs: its process and what the agent knows of it. Written
    only by :class:`LocalWorkers` (``attached`` also there, from the board)."""

    rank: int
    local: int  # LOCAL_RANK (an adopted rank keeps its original one)
    slot: int  # progress-board index
    pid: int = 0
    state: WorkerState = WorkerState.STARTING
    cause: str = ""  # why the agent ended it: hang | collateral | restart | shutdown
    attached: bool = False  # its script runs the stalwart runtime (sticky across restarts)
    t_spawn: float = 0.0


@dataclass(frozen=True)
class ProcessExit:
    """A worker process ended by itself or by a signal the agent did not send for a
    stop (``cause``: the agent's reason when it killed it for a hang, ``collateral``
    when it waited on a generation another fault ended, else empty)."""

    rank: int
    pid: int
    rc: int
    t_exit: float
    cause: str


class Zygote(Protocol):
    """What :class:`LocalWorkers` needs of agent/processes/_zygote_client.py."""

    def send(self, msg: dict[str, Any]) -> None: ...
    def events(self, timeout: float, wake: int | None = None) -> list[dict[str, Any]]: ...
    def pid(self) -> int: ...


class ProcessWatcher(Protocol):
    """Processes forked through the same zygote that are not workers (standbys)."""

    def on_spawned(self, ident: str, pid: int) -> bool: ...
    def on_exit(self, pid: int) -> bool: ...
    def used_slots(self) -> set[int]: ...
    def pids(self) -> list[int]: ...


Spec = Callable[[Worker, WorkerFields], dict[str, Any]]
Joined = Callable[[Worker], None]


class LocalWorkers:
    def __init__(self, ranks: list[int], board: ProgressBoard, zygote: Zygote) -> None:
        self.board = board
        self._zygote = zygote
        self._workers = {r: Worker(r, i, i) for i, r in enumerate(ranks)}
        self._spares: list[int] = []  # pre-forked processes, named by pid
        self._pending: dict[str, int] = {}  # zygote spawn id -> rank
        self._assign = False  # --strategy spare: a replacement takes a spare
        self._watchers: list[ProcessWatcher] = []
        self._exit_listeners: list[Callable[[int], None]] = []
        self._finish_listeners: list[Callable[[Worker], None]] = []
        self._finished: set[int] = set()  # pids whose finish the listeners were told
        self._spec: Spec = lambda w, extra: {}
        self._joined: Joined = lambda w: None

    def wire(self, spec: Spec, joined: Joined, *, assign_spares: bool) -> None:
        """``spec``: what the zygote needs to start a worker; ``joined``: told of every
        start (the ``member_join`` record); ``assign_spares``: replacements run in
        pre-forked spares (``--strategy spare``)."""
        self._spec, self._joined, self._assign = spec, joined, assign_spares

    def watch(self, watcher: ProcessWatcher) -> None:
        self._watchers.append(watcher)

    def on_any_exit(self, listener: Callable[[int], None]) -> None:
        """``listener(pid)`` for the exit of every process of the zygote."""
        self._exit_listeners.append(listener)

    def on_finish(self, listener: Callable[[Worker], None]) -> None:
        """``listener(worker)`` once per process that finished the job: its board says
        ``done`` (seen by :meth:`judged`, the runtime passed its finish barrier) or it
        exited 0, whichever the agent sees first."""
        self._finish_listeners.append(listener)

    def _finish(self, w: Worker) -> None:
        if w.pid not in self._finished:
            self._finished.add(w.pid)
            for finished in self._finish_listeners:
                finished(w)

    # ------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __contains__(self, rank: object) -> bool:
        return rank in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def ranks(self) -> list[int]:
        return list(self._workers)

    def get(self, rank: int) -> Worker | None:
        return self._workers.get(rank)

    def __getitem__(self, rank: int) -> Worker:
        return self._workers[rank]

    def slot(self, w: Worker) -> Slot:
        return self.board.read(w.slot)

    def attached(self) -> bool:
        """Every worker runs the stalwart runtime (else torchrun's route for all)."""
        return all(w.attached for w in self._workers.values())

    def running(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.state is WorkerState.RUNNING and w.pid]

    def finished(self) -> bool:
        return all(w.state in (WorkerState.DONE, WorkerState.GONE) for w in self)

    def finished_peer(self, rank: int) -> int | None:
        """A local rank other than ``rank`` that finished the job: its process exited 0,
        or its board says ``done`` (the runtime passed its finish barrier: every member
        trained to the end, so nobody will form a group with a replacement any more)."""
        for w in self._workers.values():
            if w.rank == rank:
                continue
            if w.state is WorkerState.DONE:
                return w.rank
            if w.state is WorkerState.RUNNING and w.pid:
                s = self.board.read(w.slot)
                if s.pid == w.pid and s.phase == "done":
                    return w.rank
        return None

    def all_gone(self) -> bool:
        return all(w.state is WorkerState.GONE for w in self)

    def last_step(self) -> int | None:
        steps = [self.board.read(w.slot).step for w in self._workers.values()]
        return max(steps) if steps else None

    def recovered(self, generation: int) -> bool:
        """Every running worker is in ``generation``, past its recovery (from the board:
        no store round trip)."""
        for w in self._workers.values():
            if w.state is not WorkerState.RUNNING:
                continue
            slot = self.board.read(w.slot)
            if slot.generation < generation or slot.phase not in _TRAINING:
                return False
        return True

    def free_slot(self) -> int:
        """The lowest progress-board slot no worker or standby of this node holds."""
        used = {w.slot for w in self._workers.values()}
        for watcher in self._watchers:
            used |= watcher.used_slots()
        return min(set(range(len(used) + 1)) - used)

    def judged(self) -> dict[int, Slot]:
        """The board slot of every running worker the agent did not end itself (a slot
        not written yet by its process stands for a start-up); learns ``attached``, and
        tells the finish listeners of a slot that says ``done``."""
        slots: dict[int, Slot] = {}
        for w in self._workers.values():
            if w.state is not WorkerState.RUNNING or not w.pid or w.cause:
                continue
            s = self.board.read(w.slot)
            if s.pid != w.pid:  # not written yet (start-up): only a stopped process is judged
                s = Slot(w.pid, 0, "starting", 0, w.t_spawn, 0.0, 0.0, False)
            slots[w.rank] = s
            w.attached |= s.attached
            if s.phase == "done" and s.pid == w.pid:
                self._finish(w)  # told now, not at its exit: a peer may fail meanwhile
        return slots

    # ------------------------------------------------------------ membership
    def adopt(self, rank: int, local: int, slot: int, *, pid: int = 0) -> Worker:
        """A rank this node runs from now on (a lost node's, an elastic joiner); ``pid``:
        its process already runs (a claimed standby)."""
        w = Worker(rank, local, slot, attached=self.attached() if pid == 0 else True)
        if pid:
            w.pid, w.state, w.t_spawn = pid, WorkerState.RUNNING, time.time()
        self._workers[rank] = w
        return w

    def run_in(self, w: Worker, pid: int, slot: int) -> None:
        """``w`` resumes in a parked standby process (``pid``, on board ``slot``)."""
        w.pid, w.slot, w.state, w.cause = pid, slot, WorkerState.RUNNING, ""
        w.t_spawn = time.time()

    def forget(self, ranks: set[int]) -> None:
        for rank in ranks:
            self._workers.pop(rank, None)

    def retire(self, w: Worker) -> None:
        """``w`` left the job for good (it is not started again unless it joins)."""
        w.state = WorkerState.GONE

    def activated(self, w: Worker) -> None:
        """A claimed standby of ``w`` was let run (its recovery starts now)."""
        w.t_spawn = time.time()

    # ------------------------------------------------------------ spawning
    def prefork(self) -> None:
        self._zygote.send({"op": "prefork", "id": "spare-pending"})

    def spawn(self, w: Worker, *, generation: int) -> None:
        """Start ``w``'s process: in a spare under ``--strategy spare`` after the start,
        else a fresh fork."""
        self.board.clear(w.slot)
        w.state, w.cause, w.pid, w.t_spawn = WorkerState.STARTING, "", 0, time.time()
        if self._assign and self._spares and generation > 0:
            spare = self._spares.pop(0)
            self._zygote.send({"op": "assign", "pid": spare, "spec": self._spec(w, {})})
            w.pid, w.state = spare, WorkerState.RUNNING
            self.prefork()
        else:
            self._pending[f"rank-{w.rank}"] = w.rank
            self._zygote.send({"op": "spawn", "id": f"rank-{w.rank}", "spec": self._spec(w, {})})
        self._joined(w)

    def spawn_process(self, ident: str, slot: int, spec: dict[str, Any]) -> None:
        """Fork a non-worker process (a standby) on ``slot``; a watcher claims it."""
        self.board.clear(slot)
        self._zygote.send({"op": "spawn", "id": ident, "spec": spec})

    # ------------------------------------------------------------ events
    def poll(self, timeout: float, wake: int | None = None) -> list[ProcessExit]:
        """Messages from the zygote (up to ``timeout`` for the first): the exits that
        are failures to look at, as typed events."""
        out: list[ProcessExit] = []
        for msg in self._zygote.events(timeout, wake):
            exit_ = self.on_message(msg)
            if exit_ is not None:
                out.append(exit_)
        return out

    def on_message(self, msg: dict[str, Any]) -> ProcessExit | None:
        op = msg.get("op")
        if op == "spawned":
            self._spawned(str(msg["id"]), int(msg["pid"]))
        elif op == "exit":
            return self._exited(int(msg["pid"]), int(msg["rc"]), float(msg["t"]))
        return None

    def _spawned(self, ident: str, pid: int) -> None:
        if any(watcher.on_spawned(ident, pid) for watcher in self._watchers):
            return
        if ident == "spare-pending":  # a pre-forked spare: its pid is its name from now on
            self._spares.append(pid)
            return
        rank = self._pending.pop(ident, None)
        if rank is not None:
            self._workers[rank].pid = pid
            self._workers[rank].state = WorkerState.RUNNING

    def _exited(self, pid: int, rc: int, t_exit: float) -> ProcessExit | None:
        for listener in self._exit_listeners:
            listener(pid)
        if any(watcher.on_exit(pid) for watcher in self._watchers):
            return None  # a parked standby died: the next reconcile starts another
        w = next((x for x in self._workers.values() if x.pid == pid), None)
        if w is None or w.state in (WorkerState.DONE, WorkerState.DEAD):
            return None
        if rc == 0 or w.cause == EXIT_HANG:  # ended at its exit: finished all the same
            w.state = WorkerState.DONE
            self._finish(w)
            return None
        w.state = WorkerState.DEAD
        if w.cause in ("restart", "shutdown"):
            return None
        return ProcessExit(w.rank, pid, rc, t_exit, w.cause)

    # ------------------------------------------------------------ stopping
    def kill(self, w: Worker, cause: str) -> None:
        """End ``w``'s process (its exit is reported with ``cause``)."""
        w.cause = cause
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)

    def stop_all(self, cause: str, timeout: float = 10.0) -> None:
        """SIGKILL every live worker and wait until the zygote reaped them (exits of
        other workers seen meanwhile belong to the launch being stopped)."""
        live = [w for w in self._workers.values() if w.state.live and w.pid]
        for w in live:
            self.kill(w, cause)
        deadline = time.monotonic() + timeout
        while any(not w.state.ended for w in live):
            if time.monotonic() > deadline:
                break
            for msg in self._zygote.events(0.05):
                self.on_message(msg)

    def reap_vanished(self) -> None:
        """Mark dead the workers whose process is gone though no exit was seen (after
        this agent was stopped: their events may be lost)."""
        for w in self._workers.values():
            try:
                if w.pid:
                    os.kill(w.pid, 0)
            except ProcessLookupError:
                w.state = WorkerState.DEAD

    def fence_out(self, elsewhere: Callable[[], set[int]]) -> None:
        """This node was fenced: stop every worker (their exits are no failures) and
        forget the ranks ``elsewhere`` says another node on this host runs now (their
        snapshot slots are not ours to delete at the end)."""
        self.reap_vanished()  # exits already reaped (their events may be lost)
        self.stop_all("shutdown")
        with contextlib.suppress(Exception):
            self.forget(elsewhere())

    def kill_node(self) -> None:
        """Chaos ``kill node``: every process of this node dies at once, the zygote too."""
        pids = [w.pid for w in self.running()]
        for watcher in self._watchers:
            pids += watcher.pids()
        pids.append(self._zygote.pid())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_TRAINING = ("step", "collective", "done")
