"""The agent's incident handling that is not a worker exit: hangs and lost nodes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import TYPE_CHECKING

from stalwart.agent._elastic import elastic_lost_node
from stalwart.agent._proc import read_cpu
from stalwart.agent.detect import Activity, CpuTracker, HangConfig, find_hang
from stalwart.agent.progress import Slot

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = ["HangWatch", "adopt_lost_nodes", "check_hang"]


class HangWatch:
    """The agent's view of its workers' processes between board reads: one CPU tracker
    per worker process, and the step-time history of each rank (the job's, not the
    process's: a replacement is judged, and seeded, with its rank's p99)."""

    def __init__(self, config: HangConfig) -> None:
        self.config = config
        self.history: dict[int, float] = {}  # rank -> p99 step time seen for it
        self._trackers: dict[int, tuple[int, CpuTracker]] = {}  # rank -> (pid, tracker)
        self._activity: dict[int, Activity] = {}
        self._t_sample = 0.0
        self.killed: dict[int, str] = {}  # pid -> why the agent killed it for a hang

    def sample(
        self, pids: dict[int, int], now: float, slowed: frozenset[int] = frozenset()
    ) -> dict[int, Activity]:
        """Read /proc for ``pids`` (rank -> pid) at most every 100 ms; ``slowed``: pids
        the agent's own chaos duty-cycles with SIGSTOP/SIGCONT (``slow``), not hung."""
        if now - self._t_sample < _SAMPLE_S:
            return {r: a for r, a in self._activity.items() if r in pids}
        self._t_sample = now
        activity: dict[int, Activity] = {}
        for rank, pid in pids.items():
            known = self._trackers.get(rank)
            if known is None or known[0] != pid:
                known = (pid, CpuTracker(self.config))
                self._trackers[rank] = known
            seen = read_cpu(pid)
            if seen is not None:
                state = "S" if seen[0] in ("T", "t") and pid in slowed else seen[0]
                activity[rank] = known[1].update(now, seen[1], state)
        for rank in set(self._trackers) - set(pids):
            del self._trackers[rank]
        self._activity = activity
        return activity

    def remember(self, slots: dict[int, Slot]) -> None:
        """The newest p99 each rank published (a rolling window of its recent steps)."""
        for rank, s in slots.items():
            if s.p99_s > 0:
                self.history[rank] = s.p99_s


_SAMPLE_S = 0.1


def check_hang(agent: Agent, now: float) -> None:
    """Read the progress board; kill the culprits of a hang (recovered as crashes)."""
    assert agent._board is not None
    slots: dict[int, Slot] = {}
    for w in agent.workers.values():
        if w.state != "running" or not w.pid or w.cause:
            continue
        s = agent._board.read(w.slot)
        if s.pid != w.pid:  # not written yet (start-up): only a stopped process is judged
            s = Slot(w.pid, 0, "starting", 0, w.t_spawn, 0.0, 0.0, False)
        slots[w.rank] = s
        w.attached |= s.attached
    watch = agent.hangs
    watch.remember(slots)
    slowed = frozenset(pid for _, pid, _ in agent.chaos.slowing)
    activity = watch.sample({r: agent.workers[r].pid for r in slots}, now, slowed)
    verdict = find_hang(
        slots,
        now,
        agent.cfg.hang,
        activity,
        since=agent._t_recovery,
        history=watch.history,
        whole_job=agent.cfg.nnodes == 1,
        generation=None if agent.cfg.strategy == "elastic" else agent.generation,
    )
    if verdict is None:
        return
    for rank in verdict.ranks:
        w = agent.workers[rank]
        fired = agent.ledger.fired_at(pid=w.pid)
        latency = now - fired if fired is not None else verdict.stalled_s
        agent.events.emit(
            "fault_detected",
            fault="hang",
            domain={"rank": rank, "node": agent.cfg.node_rank},
            latency_s=latency,
            how=f"{verdict.how} for {verdict.stalled_s:.2f}s "
            f"(threshold {verdict.threshold_s:.2f}s)",
        )
        agent.say(f"rank {rank} hung ({verdict.how}); detected in {latency:.2f} s, killing it")
        w.cause = "hang"
        watch.killed[w.pid] = f"hung: {verdict.how}"
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)
    agent._t_recovery = now


def watch_closed(agent: Agent, node: int) -> float | None:
    """When a watched connection to ``node`` ended (agent/_peerwatch.py): this agent's
    own watch knows without a store round trip; another agent's wrote it down."""
    watch = agent.cluster.watch
    if watch is not None and node in watch.closed_at:
        return watch.closed_at[node]
    kv = agent.cluster.store.get(f"/stalwart/{agent.cfg.job}/watch-closed/node{node}")
    return float(json.loads(kv.value)["t"]) if kv is not None else None


def adopt_lost_nodes(agent: Agent) -> None:
    """The leader (node 0; under etcd the lowest live node) takes over the ranks of a
    node whose lease expired, including ranks that node had adopted itself."""
    for node in agent.cluster.lost_nodes():
        now = time.time()
        if f"node{node}" in agent.coord.blocklisted():
            # it cordoned itself (repeated failures) and said so: just take its ranks
            agent.say(f"node {node} cordoned itself; adopting its ranks")
        else:
            fired = [
                float(str(r["t"])) for r in agent.ledger.fired().values() if r.get("node") == node
            ]
            latency = now - fired[0] if fired else agent.cfg.node_lease_s
            how = f"agent lease expired (ttl {agent.cfg.node_lease_s:.1f}s)"
            closed_at = watch_closed(agent, node)
            if closed_at is not None:  # agent/_peerwatch.py: the process died, seen at once
                how = "agent process gone: its watched connection closed, lease revoked"
                if not fired:  # no injected fault to time from: from the connection's end
                    latency = now - closed_at
            agent.events.emit(
                "fault_detected",
                fault="node_loss",
                domain={"rank": None, "node": node},
                latency_s=latency,
                how=how,
            )
            agent.say(f"node {node} lost ({how}); detected in {latency:.2f} s")
            agent.coord.block(f"node{node}", "lease expired: node lost")
            agent.events.emit(
                "isolation", member=f"node{node}", reason="lease expired", blocklisted=True
            )
        agent._t_recovery = now
        adopted = []
        for rank in agent.cluster.ranks_of(node):
            local = rank % agent.cfg.nproc_per_node  # an adopted rank keeps its LOCAL_RANK
            # a lost node's memory is gone: its ranks restore from a peer's snapshot
            agent.trash.add(agent.cluster.names.rank_dir(rank))
            standby = agent.standbys.claim(rank) if agent.standbys is not None else None
            attached = all(x.attached for x in agent.workers.values())
            w = standby or agent.new_worker(rank, local, agent.free_slot(), attached=attached)
            agent.workers[rank] = w
            adopted.append(w)
        agent.cluster.publish_ranks(list(agent.workers))
        replicas = getattr(agent, "replicas", None)
        taken = replicas.take_over([w.rank for w in adopted]) if replicas is not None else {}
        if taken:
            agent.events.emit(
                "note",
                message=f"ranks {sorted(taken)} of node {node} take over their replicas "
                f"(steps {sorted(set(taken.values()))}) from this node's memory",
            )
        if agent.cfg.strategy == "elastic" and agent._attached():
            elastic_lost_node(agent, node, adopted)
            continue
        if agent.cfg.strategy == "restart" or not agent._attached():
            agent._restart_all(f"loss of node {node}", "node_loss")
            continue
        agent._bump(f"node {node} lost")
        agent.events.emit(
            "recovery_begin",
            strategy=agent.cfg.strategy,
            generation=agent.generation,
            cause="node_loss",
        )
        for w in adopted:
            if agent.standbys is not None and agent.standbys.activate(w):
                agent.emit_join(w, standby=True)
            else:
                agent._spawn(w)
