"""Standby workers: a lost node's ranks resume in processes that already did their set-up.

When a node is lost, its adopter (its ring successor, agent/_cluster.py) used to start a
fresh process per lost rank. Before that process can restore anything it runs the
script's set-up: imports, building the model and optimizer, ``sess.track``. Here that
costs 0.3-0.4 s for 256 MB of parameters, on a GPU cluster tens of seconds (CUDA
context, NCCL, a real model's init): more than the restore from a memory replica.

With ``--standby`` every agent keeps one process per rank it would adopt, started from
its zygote as that rank and parked at the top of ``sess.steps()`` (runtime/_standby.py):
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
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.slots import open_private

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = ["Standbys", "start_standbys"]

_RECONCILE_S = 1.0  # how often the set of ranks to stand by for is read from the store


@dataclass
class _Standby:
    rank: int
    slot: int  # index on this node's progress board (kept when it becomes a worker)
    go: str  # its activation file
    ident: str  # the zygote's spawn id
    pid: int = 0
    t_spawn: float = 0.0


def start_standbys(agent: Agent) -> Standbys | None:
    """The node's standbys when ``--standby`` is set (None: off)."""
    return Standbys(agent) if agent.cfg.standby else None


class Standbys:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.by_rank: dict[int, _Standby] = {}
        self._next = 0.0
        self._claimed: dict[int, _Standby] = {}  # pid -> standby claimed, not activated
        self.activated = 0

    # ------------------------------------------------------------ which ranks
    def targets(self) -> set[int]:
        """The ranks this node would adopt if their node were lost now."""
        cluster, me = self.agent.cluster, self.agent.cfg.node_rank
        live = cluster.live_nodes()
        out: set[int] = set()
        for node in sorted(live - {me}):
            if cluster.adopter(node, live - {node}) == me:
                out |= set(cluster.ranks_of(node))
        return out - set(self.agent.workers)

    def used_slots(self) -> set[int]:
        return {s.slot for s in self.by_rank.values()}

    def reconcile(self, now: float) -> None:
        """Start the missing standbys, stop the stale ones (at most once a second, and
        only once this node's own workers train: the job's start is not slowed)."""
        if now < self._next:
            return
        self._next = now + _RECONCILE_S
        agent = self.agent
        if agent.last_step() in (None, 0) or not agent._attached():
            return  # a plain script never parks: a standby of it would train as a 2nd rank
        try:
            want = self.targets()
        except Exception:  # the store is unreachable: keep what we have
            return
        for rank in sorted(set(self.by_rank) - want):
            self._stop(self.by_rank.pop(rank))
        for rank in sorted(want - set(self.by_rank)):
            self._start(rank)

    # ------------------------------------------------------------ lifecycle
    def _start(self, rank: int) -> None:
        agent = self.agent
        assert agent._zygote is not None and agent._board is not None
        slot = agent.free_slot()
        nonce = secrets.token_hex(4)
        go = agent.cluster.names.standby_go(rank, nonce)
        sb = _Standby(rank, slot, go, ident=f"standby-{rank}-{nonce}", t_spawn=time.time())
        w = agent.new_worker(rank, rank % agent.cfg.nproc_per_node, slot, attached=True)
        spec = agent.worker_spec(w, {"standby": go})
        if spec.get("log"):  # its own file: the live rank's log is not truncated
            spec["log"] = os.path.join(os.path.dirname(spec["log"]), f"rank{rank}.standby.log")
        agent._board.clear(slot)
        self.by_rank[rank] = sb
        agent._zygote.send({"op": "spawn", "id": sb.ident, "spec": spec})

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

    def claim(self, rank: int) -> Any | None:
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
        agent = self.agent
        w = agent.new_worker(rank, rank % agent.cfg.nproc_per_node, sb.slot, attached=True)
        w.pid, w.state, w.t_spawn = sb.pid, "running", time.time()
        self._claimed[sb.pid] = sb
        return w

    def activate(self, w: Any) -> bool:
        """Let the claimed standby of ``w`` run (False: ``w`` is not a claimed standby)."""
        sb = self._claimed.pop(w.pid, None)
        if sb is None:
            return False
        tmp = f"{sb.go}.tmp"
        with open_private(tmp) as f:
            f.write('{"v": 1}\n')
        os.rename(tmp, sb.go)  # the standby sees the whole file or none (it deletes it)
        w.t_spawn = time.time()
        self.activated += 1
        return True

    def pids(self) -> list[int]:
        return [sb.pid for sb in self.by_rank.values() if sb.pid]

    def close(self) -> None:
        for sb in [*self.by_rank.values(), *self._claimed.values()]:
            self._stop(sb)
        self.by_rank.clear()
        self._claimed.clear()
