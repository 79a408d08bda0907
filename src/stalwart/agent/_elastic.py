"""The agent's side of ``--strategy elastic``: who is alive, who leaves, who joins.

The workers agree on each generation's members themselves (``stalwart.runtime._elastic``);
the agent is the authority on liveness. It keeps ``el/alive/<member>`` = the incarnation
of the process it started for that member (put before the fork, deleted the moment the
zygote reports the exit), so survivors re-form without the dead member as soon as the
agent saw it die. A dead worker is started again (as a *joiner*, admitted at a step
boundary) unless the fault that killed it was ``permanent``; a lost node's members are
adopted by node 0 as joiners, or, for ``kill node=N ... permanent``, only by a later
``join node=N``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from stalwart.chaos import Fault
from stalwart.coordinator._elastic_keys import Keys, alive_members
from stalwart.coordinator.store import Compare, Delete
from stalwart.runtime.env import WorkerFields

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = [
    "elastic_env",
    "elastic_join",
    "elastic_lost_node",
    "elastic_recover",
    "job_failure",
    "pending_joins",
]


_LIMIT, _WINDOW_S = 3, 600.0  # a member failing this often leaves for good
_FAILURES: dict[int, list[float]] = {}  # member -> recent failure times (this agent)


def _keys(agent: Agent) -> Keys:
    return Keys(agent.cfg.job)


def elastic_env(agent: Agent, w: Any) -> WorkerFields:
    """A new incarnation for ``w``, registered alive before its process exists."""
    if agent.cfg.strategy != "elastic":
        return {}
    w.incarnation = uuid.uuid4().hex[:8]
    keys = _keys(agent)
    agent.coord.store.put(keys.member(keys.alive, w.rank), w.incarnation.encode())
    return {"incarnation": w.incarnation}


def _drop(agent: Agent, member: int, inc: str, reason: str) -> None:
    """Take ``member`` out of the group now; bump the generation if it is in the
    current roster (survivors whose collective failed bump it themselves)."""
    keys = _keys(agent)
    store = agent.coord.store
    key = keys.member(keys.alive, member)
    store.txn([Compare(key, "value", "==", inc.encode())], [Delete(key)])
    gen = agent.coord.generation()
    kv = store.get(keys.gen(keys.roster, gen))
    if kv is not None and [member, inc] in _json(kv.value):
        agent.coord.advance_generation(gen, reason)
    agent.generation = agent.coord.generation()


def _json(value: bytes) -> Any:
    import json

    return json.loads(value)


def job_failure(agent: Agent) -> str | None:
    """Why a worker ended the job (e.g. it waited below MIN for too long), if one did."""
    kv = agent.coord.store.get(_keys(agent).failed)
    return None if kv is None else kv.value.decode()


def elastic_recover(agent: Agent, w: Any, cause: str, loop: str | None = None) -> None:
    """A worker died: the group goes on without it; start it again unless permanent or
    crash-looping (``loop``: the verdict, agent/verdict.py). Below MIN a member that left
    for good ends the job: the failure would repeat with every joiner."""
    _drop(agent, w.rank, w.incarnation, f"{cause} of member {w.rank}")
    agent.events.emit(
        "recovery_begin", strategy="elastic", generation=agent.generation, cause=cause
    )
    now = time.monotonic()
    times = [t for t in _FAILURES.setdefault(w.rank, []) if now - t < _WINDOW_S] + [now]
    _FAILURES[w.rank] = times
    if agent.ledger.permanent(pid=w.pid) or len(times) >= _LIMIT or loop is not None:
        w.state = "gone"
        if loop is not None:
            why = "it crash-loops"
        else:
            why = "permanent fault" if len(times) < _LIMIT else f"{_LIMIT} failures in 10 min"
        if why != "permanent fault":
            agent.coord.block(f"rank{w.rank}", why)  # never readmitted
            agent.events.emit("isolation", member=f"rank{w.rank}", reason=why, blocklisted=True)
        alive = len(alive_members(agent.coord.store, _keys(agent)))
        if why != "permanent fault" and alive < agent.cfg.min_world:
            last = getattr(agent, "last_failure", None)
            line = loop or (
                f"member {w.rank} failed {len(times)} times in 10 min"
                + (f" (last at {last.where}: {last.error})" if last is not None else "")
                + f"; {alive} members left, below MIN {agent.cfg.min_world}: fix the cause "
                "(see its log) and resume from the last checkpoint"
            )
            agent.coord.store.put(_keys(agent).failed, line.encode())
            agent.end_with_verdict(line)
        agent.say(f"member {w.rank} left for good ({why}); the job goes on without it")
        if all(x.state == "gone" for x in agent.workers.values()) and agent.cfg.node_rank == 0:
            from stalwart.agent.agent import _RunFailed

            raise _RunFailed(f"every member of node 0 left for good (last: member {w.rank})")
        return
    agent.say(f"member {w.rank} left; starting it again, it rejoins at a step boundary")
    agent._spawn(w)


def elastic_lost_node(agent: Agent, node: int, adopted: list[Any]) -> None:
    """Node 0 after a node's lease expired: its members leave the group; they are
    adopted here as joiners unless the node was killed for good."""
    for w in adopted:
        _drop(agent, w.rank, _alive_inc(agent, w.rank), f"node {node} lost")
    agent.events.emit(
        "recovery_begin", strategy="elastic", generation=agent.generation, cause="node_loss"
    )
    if agent.ledger.permanent(node=node):
        for w in adopted:
            w.state = "gone"
        agent.say(f"node {node} left for good; the job goes on with the remaining members")
        return
    for w in adopted:
        agent._spawn(w)


def _alive_inc(agent: Agent, member: int) -> str:
    keys = _keys(agent)
    kv = agent.coord.store.get(keys.member(keys.alive, member))
    return "" if kv is None else kv.value.decode()


def pending_joins(agent: Agent) -> bool:
    """A ``join`` fault of this node's members is still to come (keep the agent up)."""
    ranks = set(agent.workers)
    return any(
        f.kind == "join" and (f.node == agent.cfg.node_rank or f.rank in ranks)
        for f in agent.chaos.pending
    )


def elastic_join(agent: Agent, fault: Fault) -> bool:
    """Fire ``join rank=R`` / ``join node=N``: start the member(s) again on this node.
    Node 0 serves members of lost nodes; a live node serves its own. Returns True when
    the fault is done (fired here, or by another node)."""
    cfg = agent.cfg
    if str(fault.id) in agent.ledger.fired():
        return True
    nproc = cfg.nproc_per_node
    if fault.rank is not None:
        home, ranks = fault.rank // nproc, [fault.rank]
    else:
        assert fault.node is not None
        home, ranks = fault.node, [fault.node * nproc + i for i in range(nproc)]
    if home != cfg.node_rank:
        lost = f"node{home}" in agent.coord.blocklisted()
        if cfg.node_rank != 0 or not lost:
            return False  # its own node serves it (or it is not lost yet)
    if not agent.ledger.claim(fault, rank=fault.rank, pid=None):
        return True
    agent.events.emit(
        "fault_injected",
        fault="join",
        domain={"rank": fault.rank, "node": home},
        spec=fault.text,
    )
    agent.say(f"chaos: {fault.text}")
    for rank in ranks:
        w = agent.workers.get(rank)
        if w is None:
            attached = all(x.attached for x in agent.workers.values())
            w = agent.new_worker(rank, rank % nproc, len(agent.workers), attached=attached)
            agent.workers[rank] = w
        if w.state in ("gone", "dead"):
            agent._spawn(w)
    return True
