"""Standby workers: a lost node's ranks resume in processes that already did their set-up.

When a node is lost, its adopter (its ring successor, agent/cluster/_cluster.py) used to start a
fresh process per lost rank. Before that process can restore anything it runs the
script's set-up: imports, building the model and optimizer, ``sess.track``. Here that
costs 0.3-0.4 s for 256 MB of parameters, on a GPU cluster tens of seconds (CUDA
context, NCCL, a real model's init): more than the restore from a memory replica.

With ``--standby`` every agent keeps one process per rank it would adopt, started from
its zygote as that rank and parked at the top of ``sess.steps()`` (runtime/state/_standby.py):
set-up done, no snapshot slot opened, no group joined, nothing written. When the node is
lost the adopter activates those processes instead of starting new ones (it writes the
file each was told to watch), after the lost node's slots were replaced by the
replica; from there they recover exactly as a fresh replacement would.

Trade-off: on every node, memory and one set-up for a copy of the predecessor's ranks,
paid while nothing fails, for the set-up time off every node-loss recovery. Standbys
start once this node's own workers have completed a step (the job's start is not slowed)
and follow the ring: when the ranks this node would adopt change, stale standbys are
killed and new ones started. Only for workers under the stalwart runtime and the
``flash``/``spare`` strategies (the config refuses other combinations).

Under ``--strategy spare`` the node also stands by for **its own ranks** (issue 28):
a spare pre-forked from the zygote has only the imports done, so a replacement still
built the model, the data loader and ``sess.track`` after the failure, and a spare's
RTO was no better than flash's on a script with a real set-up. A parked standby of the
failed rank has done all of that: the failed rank resumes in it (:meth:`Standbys.take`),
restoring from the dead worker's snapshot slots like any replacement, and the next
reconcile parks a new one. Cost: one set-up and the memory of every local rank, twice.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.agent.config import LaunchConfig
from stalwart.agent.processes._workers import Worker
from stalwart.checkpoint.slots import open_private
from stalwart.contract.env import WorkerFields
from stalwart.contract.shm_names import SlotNames

__all__ = ["Standbys"]

_RECONCILE_S = 1.0  # how often the set of ranks to stand by for is read from the store


@dataclass
class _Standby:
    rank: int
    slot: int  # index on this node's progress board (kept when it becomes a worker)
    go: str  # its activation file
    ident: str  # the zygote's spawn id
    pid: int = 0
    t_spawn: float = 0.0


class Ring(Protocol):
    """What of agent/cluster/_cluster.py says which ranks this node would adopt."""

    def live_nodes(self) -> set[int]: ...
    def adopter(self, lost: int, live: set[int]) -> int | None: ...
    def ranks_of(self, node: int) -> list[int]: ...


class Workers(Protocol):
    """What of agent/processes/_workers.py's LocalWorkers the standbys use."""

    def ranks(self) -> list[int]: ...
    def last_step(self) -> int | None: ...
    def attached(self) -> bool: ...
    def free_slot(self) -> int: ...
    def spawn_process(self, ident: str, slot: int, spec: dict[str, Any]) -> None: ...
    def adopt(self, rank: int, local: int, slot: int, *, pid: int = 0) -> Worker: ...
    def run_in(self, w: Worker, pid: int, slot: int) -> None: ...


Spec = Callable[[Worker, WorkerFields], dict[str, Any]]


class Standbys:
    def __init__(
        self,
        *,
        node: int,
        nproc: int,
        names: SlotNames,
        ring: Ring,
        workers: Workers,
        spec: Spec,
        own: bool = False,
    ) -> None:
        """``own``: stand by for this node's own ranks too (``--strategy spare``)."""
        self._node, self._nproc, self._names, self._own = node, nproc, names, own
        self._ring, self._workers, self._spec = ring, workers, spec
        self.by_rank: dict[int, _Standby] = {}
        self._next = 0.0
        self._claimed: dict[int, _Standby] = {}  # pid -> standby claimed, not activated
        self.activated = 0
        self._quiet_to = 0  # start none until the job passed this step (a recovery's)

    @classmethod
    def for_node(
        cls, cfg: LaunchConfig, names: SlotNames, ring: Ring, workers: Workers, spec: Spec
    ) -> Standbys | None:
        """The node's standbys when ``--standby`` is set (None: off)."""
        if not cfg.standby:
            return None
        node, nproc, own = cfg.node_rank, cfg.nproc_per_node, cfg.strategy.uses_spares
        return cls(
            node=node, nproc=nproc, names=names, ring=ring, workers=workers, spec=spec, own=own
        )

    # ------------------------------------------------------------ which ranks
    def targets(self) -> set[int]:
        """The ranks this node would adopt if their node were lost now, and its own
        ranks when it stands by for them (``own``)."""
        cluster, me = self._ring, self._node
        live = cluster.live_nodes()
        out: set[int] = set()
        for node in sorted(live - {me}):
            if cluster.adopter(node, live - {node}) == me:
                out |= set(cluster.ranks_of(node))
        mine = set(self._workers.ranks())
        return (out - mine) | (mine if self._own else set())

    def used_slots(self) -> set[int]:
        return {s.slot for s in self.by_rank.values()}

    def reconcile(self, now: float) -> None:
        """Start the missing standbys, stop the stale ones (at most once a second, and
        only once this node's own workers train: the job's start is not slowed)."""
        if now < self._next:
            return
        self._next = now + _RECONCILE_S
        step = self._workers.last_step()
        if step in (None, 0) or not self._workers.attached():
            return  # a plain script never parks: a standby of it would train as a 2nd rank
        try:
            want = self.targets()
        except Exception:  # the store is unreachable: keep what we have
            return
        for rank in sorted(set(self.by_rank) - want):
            self._stop(self.by_rank.pop(rank))
        if step is not None and step <= self._quiet_to:
            return  # a recovery runs: a new standby's set-up would take its cores
        for rank in sorted(want - set(self.by_rank)):
            self._start(rank)

    # ------------------------------------------------------------ lifecycle
    def _start(self, rank: int) -> None:
        slot = self._workers.free_slot()
        nonce = secrets.token_hex(4)
        go = self._names.standby_go(rank, nonce)
        sb = _Standby(rank, slot, go, ident=f"standby-{rank}-{nonce}", t_spawn=time.time())
        w = Worker(rank, rank % self._nproc, slot, attached=True)  # what it will run as
        spec = self._spec(w, {"standby": go})
        if spec.get("log"):  # its own file: the live rank's log is not truncated
            spec["log"] = os.path.join(os.path.dirname(spec["log"]), f"rank{rank}.standby.log")
        self.by_rank[rank] = sb
        self._workers.spawn_process(sb.ident, slot, spec)

    def _stop(self, sb: _Standby) -> None:
        if sb.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(sb.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.unlink(sb.go)

    def on_spawned(self, ident: str, pid: int) -> bool:
        """The zygote forked a standby (False: not one of ours)."""
        for sb in self.by_rank.values():
            if sb.ident == ident:
                sb.pid = pid
                return True
        return ident.startswith("standby-")  # a stale one, stopped meanwhile

    def on_exit(self, pid: int) -> bool:
        """A standby died before it was needed: forget it (the next reconcile starts
        another). False: ``pid`` is not a standby."""
        for rank, sb in list(self.by_rank.items()):
            if sb.pid == pid:
                del self.by_rank[rank]
                with contextlib.suppress(OSError):
                    os.unlink(sb.go)
                return True
        return False

    def claim(self, rank: int) -> Worker | None:
        """The worker for ``rank`` in its standby process, not yet activated; None when
        no standby process for it runs (the caller starts a fresh one)."""
        sb = self.by_rank.get(rank)
        if sb is None or not sb.pid:
            return None
        try:
            os.kill(sb.pid, 0)
        except ProcessLookupError:
            return None
        del self.by_rank[rank]
        self._claimed[sb.pid] = sb
        return self._workers.adopt(rank, rank % self._nproc, sb.slot, pid=sb.pid)

    def take(self, w: Worker) -> bool:
        """Resume the failed local rank ``w`` in its parked standby and let it run
        (False: none runs for it; the caller starts a spare or a fresh process)."""
        sb = self.by_rank.get(w.rank)
        if not self._own or sb is None or not sb.pid:
            return False
        try:
            os.kill(sb.pid, 0)
        except ProcessLookupError:
            return False
        del self.by_rank[w.rank]
        self._quiet_to = self._workers.last_step() or 0  # the step the job failed at
        self._workers.run_in(w, sb.pid, sb.slot)
        self._claimed[sb.pid] = sb
        return self.activate(w)

    def activate(self, w: Worker) -> bool:
        """Let the claimed standby of ``w`` run (False: ``w`` is not a claimed standby)."""
        sb = self._claimed.pop(w.pid, None)
        if sb is None:
            return False
        tmp = f"{sb.go}.tmp"
        with open_private(tmp) as f:
            f.write('{"v": 1}\n')
        os.rename(tmp, sb.go)  # the standby sees the whole file or none (it deletes it)
        self.activated += 1
        return True

    def pids(self) -> list[int]:
        return [sb.pid for sb in self.by_rank.values() if sb.pid]

    def close(self) -> None:
        for sb in [*self.by_rank.values(), *self._claimed.values()]:
            self._stop(sb)
        self.by_rank.clear()
        self._claimed.clear()
