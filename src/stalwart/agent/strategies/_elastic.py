"""``--strategy elastic``: who is alive, who leaves, who joins (the agent's side).

The workers agree on each generation's members themselves (``stalwart.runtime``); the
agent is the authority on liveness. It keeps ``el/alive/<member>`` = the incarnation of
the process it started for that member (put before the fork, deleted the moment the
zygote reports the exit), so survivors re-form without the dead member as soon as the
agent saw it die. A dead worker is started again (as a *joiner*, admitted at a step
boundary) unless the fault that killed it was ``permanent``, or it failed as often as
the coordinator's failure threshold allows (its ``record_failure``), or it crash-loops;
a lost node's members are adopted as joiners, or, for ``kill node=N ... permanent``,
only by a later ``join node=N`` (:class:`Joins`).

A sharded (FSDP2) job cannot change size in place (:class:`ShardedResize`): FSDP2 fixes
a module's shards and the optimizer's DTensor moments to the mesh it was built on, so a
survivor process cannot go on at another size (runtime/comm/_fsdp.py ``resize_by_restarts``;
its ``sess.mesh`` puts ``el/sharded`` in the job's store). When that key is set, a
member's loss or join starts every worker of the new membership again, at once, each
with its dense rank (launch-rank order) and the new ``WORLD_SIZE``: they restore the
newest persisted step resharded onto that world, and the loader re-partitions the epoch
under the batch policy. A member that is started again (not a permanent fault) keeps the
size; ``permanent`` shrinks it; a ``join`` grows it back. One node only (the worker
refuses more).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from stalwart.agent._outcome import RunFailed, end_with_verdict
from stalwart.agent.detection.incidents import Incident, NodeLost, WorkerExited
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.agent.strategies.policy import RecoveryParts
from stalwart.chaos import Fault
from stalwart.contract.env import WorkerFields
from stalwart.coordinator.elastic_keys import Keys, alive_members
from stalwart.coordinator.store import Compare, Delete

__all__ = ["ElasticPolicy", "Joins", "ShardedResize"]


class ElasticPolicy:
    name = "elastic"
    judges_generation = False  # members re-form at step boundaries themselves
    assigns_spares = False

    def __init__(self, parts: RecoveryParts, joins: Joins) -> None:
        self._p = parts
        self._joins = joins
        self._keys = Keys(parts.cfg.job)
        self._incarnations: dict[int, str] = {}  # rank -> its current process's life
        self._sharded = ShardedResize(parts, self._keys)  # FSDP2: resized by restarts
        joins.route(self._start_joiners)

    def worker_env(self, worker: Worker) -> WorkerFields:
        """A new incarnation for ``worker``, registered alive before its process exists."""
        inc = uuid.uuid4().hex[:8]
        self._incarnations[worker.rank] = inc
        self._p.coord.store.put(self._keys.member(self._keys.alive, worker.rank), inc.encode())
        return {"incarnation": inc, **self._sharded.fields(worker)}

    def _start_joiners(self, joiners: list[Worker]) -> None:
        """A ``join``: each joiner is admitted at a step boundary; a sharded job's
        workers all start again at the larger size instead."""
        if self._sharded.active():
            ranks = [w.rank for w in joiners]
            grown = self._sharded.members() + [w for w in joiners if w.state is WorkerState.GONE]
            self._p.begin(self.name, "join")
            self._sharded.restart(grown, f"member(s) {ranks} join")
            return
        for w in joiners:
            self._p.spawn(w)

    def keeps_running(self) -> bool:
        return self._joins.pending()

    def on_incident(self, incident: Incident) -> None:
        if isinstance(incident, NodeLost):
            self._node_lost(incident)
            return
        kv = self._p.coord.store.get(self._keys.failed)
        if kv is not None:  # a worker ended the job (it waited below MIN for too long)
            why = kv.value.decode()
            self._p.say(why)
            raise RunFailed(why)
        self._worker_exited(incident)

    def _drop(self, member: int, inc: str, reason: str) -> None:
        """Take ``member`` out of the group now; bump the generation if it is in the
        current roster (survivors whose collective failed bump it themselves)."""
        coord, keys = self._p.coord, self._keys
        key = keys.member(keys.alive, member)
        coord.store.txn([Compare(key, "value", "==", inc.encode())], [Delete(key)])
        gen = coord.generation()
        kv = coord.store.get(keys.gen(keys.roster, gen))
        if kv is not None and [member, inc] in _json(kv.value):
            coord.advance_generation(gen, reason)
        self._p.generation.sync()

    def _worker_exited(self, ex: WorkerExited) -> None:
        """The group goes on without it; start it again unless permanent, failing too
        often or crash-looping. Below MIN a member that left for good ends the job: the
        failure would repeat with every joiner."""
        p = self._p
        self._drop(ex.rank, self._incarnations.get(ex.rank, ""), f"{ex.cause} of member {ex.rank}")
        p.begin(self.name, ex.cause)
        w = p.workers[ex.rank]
        limit = p.coord.config.failure_threshold
        often = not ex.collateral and p.coord.record_failure(f"rank{ex.rank}", ex.cause)
        if not (p.ledger.permanent(pid=ex.pid) or often or ex.verdict is not None):
            if self._sharded.active():  # the same size, every worker new
                self._sharded.restart(self._sharded.members(), f"member {ex.rank} left")
                return
            p.say(f"member {ex.rank} left; starting it again, it rejoins at a step boundary")
            p.spawn(w)
            return
        p.workers.retire(w)
        if ex.verdict is not None:
            why = "it crash-loops"
        else:
            why = f"{limit} failures in 10 min" if often else "permanent fault"
        if why != "permanent fault":
            p.coord.block(f"rank{ex.rank}", why)  # never readmitted
            p.events.emit("isolation", member=f"rank{ex.rank}", reason=why, blocklisted=True)
        alive = len(alive_members(p.coord.store, self._keys))
        if why != "permanent fault" and alive < p.cfg.min_world:
            last = ex.failure
            line = ex.verdict or (
                f"member {ex.rank} failed {limit} times in 10 min"
                f" (last at {last.where}: {last.error})"
                f"; {alive} members left, below MIN {p.cfg.min_world}: fix the cause "
                "(see its log) and resume from the last checkpoint"
            )
            p.coord.store.put(self._keys.failed, line.encode())
            end_with_verdict(p.launch, line)
        if self._sharded.active():  # the rest start again at the smaller size
            self._sharded.restart(self._sharded.members(), f"member {ex.rank} left for good")
            return
        p.say(f"member {ex.rank} left for good ({why}); the job goes on without it")
        if p.workers.all_gone() and p.cfg.node_rank == 0:
            raise RunFailed(f"every member of node 0 left for good (last: member {ex.rank})")

    def _node_lost(self, lost: NodeLost) -> None:
        """A node's lease expired: its members leave the group; they are adopted here as
        joiners unless the node was killed for good."""
        p = self._p
        for rank in lost.ranks:
            self._drop(rank, self._alive_inc(rank), f"node {lost.node} lost")
        p.begin(self.name, "node_loss")
        if p.ledger.permanent(node=lost.node):
            for rank in lost.ranks:
                p.workers.retire(p.workers[rank])
            p.say(f"node {lost.node} left for good; the job goes on with the remaining members")
            return
        for rank in lost.ranks:
            p.spawn(p.workers[rank])

    def _alive_inc(self, member: int) -> str:
        kv = self._p.coord.store.get(self._keys.member(self._keys.alive, member))
        return "" if kv is None else kv.value.decode()


def _json(value: bytes) -> Any:
    return json.loads(value)


class Joins:
    """Chaos ``join rank=R`` / ``join node=N``: start the member(s) again on this node.
    Node 0 serves members of lost nodes; a live node serves its own."""

    def __init__(self, parts: RecoveryParts) -> None:
        self._p = parts
        self._plan: Callable[[], list[Fault]] = list
        self._start: Callable[[list[Worker]], None] = self._spawn_each

    def route(self, start: Callable[[list[Worker]], None]) -> None:
        """``start(joiners)`` starts a join's members (the policy's: a sharded job
        restarts all of its workers at the larger size)."""
        self._start = start

    def _spawn_each(self, joiners: list[Worker]) -> None:
        for w in joiners:
            self._p.spawn(w)

    def follow(self, pending: Callable[[], list[Fault]]) -> None:
        """``pending``: this node's chaos faults still to fire (agent/processes/_chaos.py)."""
        self._plan = pending

    def pending(self) -> bool:
        """A ``join`` of this node's members is still to come (keep the agent up)."""
        p = self._p
        ranks = set(p.workers.ranks())
        return any(
            f.kind == "join" and (f.node == p.cfg.node_rank or f.rank in ranks)
            for f in self._plan()
        )

    def fire(self, fault: Fault) -> bool:
        """True when the fault is done (fired here, or by another node)."""
        p, cfg = self._p, self._p.cfg
        if str(fault.id) in p.ledger.fired():
            return True
        nproc = cfg.nproc_per_node
        if fault.rank is not None:
            home, ranks = fault.rank // nproc, [fault.rank]
        else:
            assert fault.node is not None
            home, ranks = fault.node, [fault.node * nproc + i for i in range(nproc)]
        if home != cfg.node_rank:
            lost = f"node{home}" in p.coord.blocklisted()
            if cfg.node_rank != 0 or not lost:
                return False  # its own node serves it (or it is not lost yet)
        if not p.ledger.claim(fault, rank=fault.rank, pid=None):
            return True
        p.events.emit(
            "fault_injected",
            fault="join",
            domain={"rank": fault.rank, "node": home},
            spec=fault.text,
        )
        p.say(f"chaos: {fault.text}")
        joiners = []
        for rank in ranks:
            w = p.workers.get(rank)
            if w is None:
                w = p.workers.adopt(rank, rank % nproc, len(p.workers))
            if w.state in (WorkerState.GONE, WorkerState.DEAD):
                joiners.append(w)
        if joiners:
            self._start(joiners)
        return True


class ShardedResize:
    """Owns the resized world: which launch ranks are members and their dense ranks."""

    def __init__(self, parts: RecoveryParts, keys: Keys) -> None:
        self._p = parts
        self._keys = keys
        self._seen = False
        self._ranks: dict[int, int] | None = None  # launch rank -> rank (None: launch's)

    def active(self) -> bool:
        """The job's workers built a ``sess.mesh`` under elastic (read once it is set)."""
        if not self._seen:
            self._seen = self._p.coord.store.get(self._keys.sharded) is not None
        return self._seen

    def fields(self, worker: Worker) -> WorkerFields:
        """The rank and world size of ``worker``'s next process (none: the launch's)."""
        if self._ranks is None or worker.rank not in self._ranks:
            return {}
        return {"rank": self._ranks[worker.rank], "world_size": len(self._ranks)}

    def members(self) -> list[Worker]:
        """The workers that are in the job (not left for good)."""
        return [w for w in self._p.workers if w.state is not WorkerState.GONE]

    def restart(self, members: list[Worker], what: str) -> None:
        """Every worker of ``members`` starts again at ``len(members)`` ranks (the caller
        wrote ``recovery_begin``); a ``resize`` event when the size changes."""
        p = self._p
        size = len(members)
        if size < p.cfg.min_world:
            line = (
                f"{what}: the FSDP2 job would have {size} members, fewer than its minimum "
                f"{p.cfg.min_world}; lower MIN in --nproc-per-node MIN:MAX, or resume from "
                "the last checkpoint with more workers"
            )
            p.coord.store.put(self._keys.failed, line.encode())
            end_with_verdict(p.launch, line)
        before = len(self._ranks) if self._ranks is not None else p.cfg.world_size
        self._ranks = {w.rank: i for i, w in enumerate(sorted(members, key=lambda w: w.rank))}
        p.launch.publish("last-done", {"step": p.workers.last_step() or 0})
        gen = p.generation.restart(what, world_size=size)
        if size != before:
            why = "grow" if size > before else "shrink"
            p.events.emit(
                "resize", world_size=size, from_world_size=before, reason=why, generation=gen
            )
        p.workers.stop_all("resize")
        p.generation.restarted()
        if size == before:
            how = f"at the same size ({size}): a sharded job cannot re-form in place"
        else:
            how = f"at {size} (was {before}), the newest persisted step resharded"
        p.say(f"{what}: restarting the FSDP2 job's workers {how}")
        for w in sorted(members, key=lambda w: w.rank):
            p.spawn(w)
