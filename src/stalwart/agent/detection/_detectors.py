"""The agent's detectors: each turns what it observes into typed incidents.

- :class:`CrashDetector`: a worker process that failed (from the zygote's exit events,
  agent/processes/_workers.py) -> :class:`~stalwart.agent.detection.incidents.WorkerExited`,
  with where it failed and the crash-loop verdict (agent/detection/verdict.py);
- :class:`HangDetector`: the progress board and each process's CPU time (the decision
  is agent/detection/hang.py's, the reading agent/processes/_proc.py's) -> ``WorkerHung``;
- :class:`NodeLossDetector`: node leases (agent/cluster/_cluster.py) -> ``NodeLost``;
- :class:`StragglerDetector`: the board's compute times, scored against each other by
  agent/detection/stragglers.py -> ``Straggler``, with its ``fault_detected`` and
  ``straggler`` records; under ``--on-straggler evict`` it ends the rank's process;
- a data plane cut while every lease holds: agent/detection/_dataplane_watch.py;
- a degraded link (the step rate collapses, compute as before):
  agent/detection/_degraded_watch.py.

Each writes the ``fault_detected`` record (its latency included); the policy recovers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.agent._types import EventSink, NodeContext, Say
from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.detection._dataplane_watch import DataPlaneWatch, holder_node, revoke_node
from stalwart.agent.detection._degraded_watch import LinkDetector
from stalwart.agent.detection._finished import (
    ExitHang,
    ExitWatch,
    finishing_rank,
    skip_adoption,
)
from stalwart.agent.detection._hangwatch import HangWatch
from stalwart.agent.detection.hang import HangConfig, HangVerdict, find_hang
from stalwart.agent.detection.incidents import (
    COLLATERAL,
    NodeLost,
    Straggler,
    WorkerExited,
    WorkerHung,
)
from stalwart.agent.detection.stragglers import (
    ComputeExchange,
    Declared,
    PeerMedians,
    StragglerAction,
    StragglerConfig,
    StragglerWindows,
)
from stalwart.agent.detection.verdict import (
    CrashLoops,
    Failure,
    error_line,
    error_line_path,
    failed_at,
)
from stalwart.agent.processes._env import error_message
from stalwart.agent.processes._workers import EXIT_HANG, LocalWorkers, ProcessExit
from stalwart.chaos import FaultLedger
from stalwart.contract.board import Slot
from stalwart.coordinator import Coordinator

__all__ = [
    "CrashDetector",
    "Detectors",
    "HangDetector",
    "HangWatch",
    "NodeLossDetector",
    "StragglerDetector",
]


_DETECTED = ("hang", COLLATERAL, "straggler")  # an agent's kill: reported before it


class CrashDetector:
    """A failed worker process -> :class:`WorkerExited` (its ``fault_detected`` and
    ``member_leave`` records written, its failure counted for the crash-loop verdict)."""

    def __init__(
        self,
        *,
        node: int,
        run_dir: str,
        workers: LocalWorkers,
        hangs: HangWatch,
        loops: CrashLoops,
        ledger: FaultLedger,
        events: EventSink,
        say: Say,
    ) -> None:
        self._node, self._run_dir = node, run_dir
        self._workers, self._hangs, self._loops = workers, hangs, loops
        self._ledger, self._events, self._say = ledger, events, say
        self.last_failure: Failure | None = None

    def examine(self, exit_: ProcessExit) -> WorkerExited:
        rank, pid, rc = exit_.rank, exit_.pid, exit_.rc
        recorded = None
        collateral = exit_.cause == COLLATERAL
        if exit_.cause not in _DETECTED:  # its detector wrote its fault_detected
            fired = self._ledger.fired_at(pid=pid)
            latency = time.time() - (fired if fired is not None else exit_.t_exit)
            how = f"process exit (rc {rc})"
            if (recorded := error_message(self._run_dir, rank, pid)) is not None:
                how += f": {recorded}"  # what its @record wrote (TORCHELASTIC_ERROR_FILE)
            domain = {"rank": rank, "node": self._node}
            self._events.emit(
                "fault_detected", fault="crash", domain=domain, latency_s=latency, how=how
            )
            self._say(f"rank {rank} crashed ({how}); detected in {latency * 1000:.0f} ms")
        self._events.emit(
            "member_leave",
            member=f"rank{rank}",
            node=self._node,
            rank=rank,
            reason=exit_.cause or f"exit rc {rc}",
        )
        cause = exit_.cause or "crash"
        where = failed_at(self._workers.slot(self._workers[rank]), pid)
        path = error_line_path(self._run_dir, rank)
        error = error_line(path, rc, self._hangs.killed.pop(pid, ""))  # (removes the file)
        error = recorded or error
        failure = Failure(rank, where, error, cause)
        if collateral:  # another rank's fault: not a failure of this rank's to count
            return WorkerExited(rank, pid, rc, cause, failure, None, collateral=True)
        self.last_failure = failure
        workers = self._workers
        started = any(failed_at(workers.slot(w), w.pid) != "start-up" for w in workers if w.pid)
        loop = self._loops.record(failure, job_started=started)
        return WorkerExited(rank, pid, rc, cause, failure, loop)


class HangDetector:
    """The progress board and /proc -> :class:`WorkerHung` (agent/detection/hang.py decides)."""

    def __init__(
        self,
        *,
        config: HangConfig,
        node: int,
        whole_job: bool,
        workers: LocalWorkers,
        watch: HangWatch,
        ledger: FaultLedger,
        events: EventSink,
        say: Say,
        exits: ExitWatch,
    ) -> None:
        """``exits``: once a rank finished the job, the exit-hang rule replaces the rest."""
        self._config, self._node, self._whole_job = config, node, whole_job
        self._workers, self._watch, self._exits = workers, watch, exits
        self._ledger, self._events, self._say = ledger, events, say
        self._t_recovery = 0.0  # nobody is blamed for the time before a recovery began

    def recovery_began(self, now: float) -> None:
        self._t_recovery = now

    def check(
        self, now: float, *, generation: int | None, slowed: frozenset[int]
    ) -> list[WorkerHung]:
        """``generation``: the job's (None: members re-form by themselves, elastic);
        ``slowed``: pids the agent's chaos duty-cycles (``slow``), not hung."""
        slots = self._workers.judged()
        watch = self._watch
        watch.remember(slots)
        pids = {r: self._workers[r].pid for r in slots}
        activity = watch.sample(pids, now, slowed)
        runtime = {r for r in slots if self._workers[r].attached}
        finishing, at_exit = self._exits.check(slots, activity, now, runtime)
        if finishing:  # never a restart once a rank finished the job: end the stuck ones
            if at_exit is None:
                return []
            self._end_at_exit(at_exit, slots)
            return [
                self._short_of_finish(r, pids[r], at_exit, slots[r]) for r in at_exit.unfinished
            ]
        verdict = find_hang(
            slots,
            now,
            self._config,
            activity,
            since=self._t_recovery,
            history=watch.history,
            whole_job=self._whole_job,
            generation=generation,
        )
        if verdict is None:
            return []
        self._t_recovery = now
        if verdict.collateral:
            return [self._collateral(rank, pids[rank], verdict) for rank in verdict.ranks]
        hung = []
        for rank in verdict.ranks:
            fired = self._ledger.fired_at(pid=pids[rank])
            latency = now - fired if fired is not None else verdict.stalled_s
            self._events.emit(
                "fault_detected",
                fault="hang",
                domain={"rank": rank, "node": self._node},
                latency_s=latency,
                how=f"{verdict.how} for {verdict.stalled_s:.2f}s "
                f"(threshold {verdict.threshold_s:.2f}s)",
            )
            self._say(f"rank {rank} hung ({verdict.how}); detected in {latency:.2f} s, killing it")
            h = WorkerHung(
                rank, pids[rank], verdict.how, verdict.stalled_s, verdict.threshold_s, latency
            )
            hung.append(h)
        return hung

    def _end_at_exit(self, hang: ExitHang, slots: dict[int, Slot]) -> None:
        """Kill the ranks stuck after the job's end; their exits count as finishes."""
        for rank in hang.ranks:
            line = hang.line(rank, slots[rank].step)
            self._events.emit("note", message=line)
            self._say(line)
            self._workers.kill(self._workers[rank], EXIT_HANG)

    def _short_of_finish(self, rank: int, pid: int, hang: ExitHang, slot: Slot) -> WorkerHung:
        """A runtime rank idle short of the finish barrier once a peer finished: a hang
        (its strategy recovers it, or ends the job with its failure), never a finish."""
        how = hang.short_of_finish(slot)
        domain = {"rank": rank, "node": self._node}
        self._events.emit(
            "fault_detected",
            fault="hang",
            domain=domain,
            latency_s=hang.idle_s,
            how=f"{how} for {hang.idle_s:.2f}s (--exit-grace {hang.grace_s:g}s)",
        )
        self._say(f"rank {rank} hung ({how}); killing it")
        return WorkerHung(rank, pid, how, hang.idle_s, hang.grace_s, hang.idle_s)

    def _collateral(self, rank: int, pid: int, verdict: HangVerdict) -> WorkerHung:
        """A survivor left behind by another fault's recovery: no fault of its own (no
        ``fault_detected``), killed so that it re-forms (its ``member_leave`` says why)."""
        self._say(
            f"rank {rank} {verdict.how} for {verdict.stalled_s:.2f} s; killing it so that "
            "it re-forms (collateral of another fault: not counted as a failure of its own)"
        )
        return WorkerHung(
            rank, pid, verdict.how, verdict.stalled_s, verdict.threshold_s, 0.0, collateral=True
        )

    def isolate(self, hung: WorkerHung) -> None:
        """Kill the hung worker; its exit is recovered as a failure with cause ``hang``
        (``collateral`` for a survivor another fault left behind: not counted)."""
        cause = COLLATERAL if hung.collateral else "hang"
        self._watch.killed[hung.pid] = f"{'collateral' if hung.collateral else 'hung'}: {hung.how}"
        self._workers.kill(self._workers[hung.rank], cause)


class Nodes(Protocol):
    """What of agent/cluster/_cluster.py the node-loss and straggler detectors need (the
    straggler detector: the launch records it exchanges window medians through)."""

    def lost_nodes(self) -> list[int]: ...
    def ranks_of(self, node: int) -> list[int]: ...
    def watch_closed_at(self, node: int) -> float | None: ...
    def blocklisted(self) -> set[str]: ...
    def publish(self, key: str, record: dict[str, Any]) -> None: ...
    def read(self, key: str, timeout: float) -> dict[str, Any]: ...
    def published(self, key: str) -> dict[str, Any] | None: ...


class NodeLossDetector:
    """Node leases -> :class:`NodeLost`, each lost node reported to one agent (its
    adopter), once; the node is blocklisted (isolated) here."""

    def __init__(
        self,
        *,
        nodes: Nodes,
        coord: Coordinator,
        lease_s: float,
        ledger: FaultLedger,
        events: EventSink,
        say: Say,
        finished: Callable[[], int | None] = lambda: None,
        grace_s: float = 0.0,
    ) -> None:
        """``finished``: a rank that finished the job, if one did (agent/detection/_finished.py):
        a node lost after that is isolated but its ranks are not adopted. ``grace_s``: the
        partition grace a silent expiry waited (agent/cluster/_grace.py), part of its latency."""
        self._nodes, self._coord, self._lease_s, self._finished = nodes, coord, lease_s, finished
        self._grace_s = grace_s
        self._ledger, self._events, self._say = ledger, events, say

    def check(self) -> list[NodeLost]:
        gone = self._nodes.lost_nodes()
        done = self._finished() if gone else None
        lost = [self._lost(node, adopted=done is None) for node in gone]
        return [n for n in lost if not skip_adoption(n, done, self._events, self._say)]

    def _lost(self, node: int, *, adopted: bool = True) -> NodeLost:
        now = time.time()
        if f"node{node}" in self._nodes.blocklisted():
            # it cordoned itself (repeated failures, a probe) and said so: take its ranks
            self._say(f"node {node} cordoned itself" + ("; adopting its ranks" if adopted else ""))
            return NodeLost(node, tuple(self._nodes.ranks_of(node)), "cordoned", 0.0, True)
        fired = [float(str(r["t"])) for r in self._ledger.fired().values() if r.get("node") == node]
        latency = now - fired[0] if fired else self._lease_s + self._grace_s
        how = f"agent lease expired (ttl {self._lease_s:.1f}s)"
        if self._grace_s > 0:
            how += f" and the partition grace ({self._grace_s:.1f}s) passed"
        closed_at = self._nodes.watch_closed_at(node)
        if closed_at is not None:  # agent/cluster/_peerwatch.py: the process died, seen at once
            how = "agent process gone: its watched connection closed, lease revoked"
            if not fired:  # no injected fault to time from: from the connection's end
                latency = now - closed_at
        if (cut := self._nodes.published(f"cut-node{node}")) is not None:
            how = f"lease revoked: {cut['how']}"  # _dataplane_watch.py: from the stall
            latency = latency if fired else now - float(cut["t0"])
        self._events.emit(
            "fault_detected",
            fault="node_loss",
            domain={"rank": None, "node": node},
            latency_s=latency,
            how=how,
        )
        self._say(f"node {node} lost ({how}); detected in {latency:.2f} s")
        self._coord.block(f"node{node}", "lease expired: node lost")
        self._events.emit(
            "isolation", member=f"node{node}", reason="lease expired", blocklisted=True
        )
        return NodeLost(node, tuple(self._nodes.ranks_of(node)), how, latency, False)


class Killed(Protocol):
    """Where the agent notes why it killed a process (HangWatch.killed): the failure's
    error line."""

    killed: dict[int, str]


class StragglerDetector:
    """The board's compute times -> :class:`Straggler` (agent/detection/stragglers.py decides);
    writes ``fault_detected`` (fault ``straggler``) and the ``straggler`` event."""

    def __init__(
        self,
        *,
        config: StragglerConfig,
        node: int,
        workers: LocalWorkers,
        watch: Killed,
        ledger: FaultLedger,
        events: EventSink,
        say: Say,
        peers: PeerMedians | None = None,
    ) -> None:
        self._node, self._workers, self._watch, self._peers = node, workers, watch, peers
        self._ledger, self._events, self._say = ledger, events, say
        self.windows = StragglerWindows(config)
        self._evict = config.action is StragglerAction.EVICT

    def check(self, now: float) -> list[Straggler]:
        declared = self.windows.observe(self._workers.judged(), now, self._peers)
        return [self._report(d, now) for d in declared]

    def _report(self, d: Declared, now: float) -> Straggler:
        sc, domain = d.score, {"rank": d.score.rank, "node": self._node}
        fired = self._ledger.fired_at(pid=d.pid)
        latency = now - (fired if fired is not None else d.t_first)
        seen = (
            f"{d.windows} windows in a row"
            if d.windows == d.of
            else (f"{d.windows} of its last {d.of} windows")
        )
        how = (
            f"computes {sc.compute_s * 1000:.1f} ms per step, {sc.ratio:.2f}x the other ranks' "
            f"median {sc.median_s * 1000:.1f} ms (robust z {sc.z:.1f}) for {seen}"
        )
        self._events.emit(
            "fault_detected", fault="straggler", domain=domain, latency_s=latency, how=how
        )
        action = "evict" if self._evict else "report"
        self._events.emit(
            "straggler",
            domain=domain,
            compute_s=sc.compute_s,
            median_s=sc.median_s,
            ratio=sc.ratio,
            score=sc.z,
            windows=d.windows,
            action=action,
            latency_s=latency,
        )
        then = "evicting it" if self._evict else "reported (--on-straggler evict replaces it)"
        self._say(f"rank {sc.rank} is a straggler ({how}); detected in {latency:.1f} s, {then}")
        return Straggler(
            sc.rank, d.pid, self._node, sc.compute_s, sc.median_s, sc.ratio, sc.z,
            d.windows, latency, self._evict,
        )  # fmt: skip

    def isolate(self, s: Straggler) -> None:
        """Under ``evict``: end the rank's process; its exit is recovered as a failure
        with cause ``straggler`` by the strategy (a spare, flash, restart, elastic)."""
        w = self._workers.get(s.rank)
        if not s.evict or w is None or w.pid != s.pid:
            return
        self._watch.killed[s.pid] = f"evicted as a straggler ({s.ratio:.2f}x the others)"
        self._workers.kill(w, "straggler")


@dataclass(frozen=True)
class Detectors:
    """The node's detectors, built once from the config."""

    crashes: CrashDetector
    hangs: HangDetector
    lost: NodeLossDetector
    stragglers: StragglerDetector
    dataplane: DataPlaneWatch | None = (
        None  # agent/detection/_dataplane_watch.py (None on one node)
    )
    link: LinkDetector | None = None  # agent/detection/_degraded_watch.py (None on one node)

    @classmethod
    def for_node(
        cls, ctx: NodeContext, workers: LocalWorkers, watch: HangWatch, nodes: Cluster
    ) -> Detectors:
        cfg, run_dir, ledger, events, say = ctx.cfg, ctx.run_dir, ctx.ledger, ctx.events, ctx.say
        node = cfg.node_rank
        crashes = CrashDetector(
            node=node,
            run_dir=run_dir,
            workers=workers,
            hangs=watch,
            loops=CrashLoops(cfg.crash_loop_limit),
            ledger=ledger,
            events=events,
            say=say,
        )
        finished = lambda: finishing_rank(workers, nodes, cfg.world_size)  # noqa: E731
        hangs = HangDetector(
            config=cfg.hang,
            node=node,
            whole_job=cfg.nnodes == 1,
            workers=workers,
            watch=watch,
            ledger=ledger,
            events=events,
            say=say,
            exits=ExitWatch(finished, cfg.hang.exit_grace_s),
        )
        lost = NodeLossDetector(
            nodes=nodes,
            coord=nodes.coord,
            lease_s=cfg.node_lease_s,
            ledger=ledger,
            events=events,
            say=say,
            finished=finished,
            grace_s=cfg.partition_grace_s,
        )
        peers = None
        if cfg.nnodes > 1:  # the job's ranks, not only this node's (one write per window)
            peers = ComputeExchange(nodes, node, cfg.nnodes, cfg.straggler.window_s)
        stragglers = StragglerDetector(
            config=cfg.straggler,
            node=node,
            workers=workers,
            watch=watch,
            ledger=ledger,
            events=events,
            say=say,
            peers=peers,
        )
        dataplane = DataPlaneWatch.for_node(ctx, workers, watch, nodes)
        return cls(crashes, hangs, lost, stragglers, dataplane, _link(ctx, workers, nodes))

    def recovery_began(self, now: float) -> None:
        """Nobody is blamed (nor a stall probed) for the time before a recovery began."""
        self.hangs.recovery_began(now)
        if self.dataplane is not None:
            self.dataplane.recovery_began(now)

    def watch_progress(self, now: float, generation: int | None, slowed: frozenset[int]) -> None:
        """The board's readers, once per loop turn: a hung rank is isolated at once, a
        straggler only under ``--on-straggler evict`` (else it is reported)."""
        for hung in self.hangs.check(now, generation=generation, slowed=slowed):
            self.hangs.isolate(hung)
        for slow in self.stragglers.check(now):
            self.stragglers.isolate(slow)
        if self.dataplane is not None:  # a cut data plane: a side fenced (or us: raises)
            self.dataplane.check(now, slowed)
        if self.link is not None:  # a degraded link: reported, or its far node evicted
            self.link.check(now)


def _link(ctx: NodeContext, workers: LocalWorkers, cluster: Cluster) -> LinkDetector | None:
    """The degraded-link detector of a job of several nodes (None on one node); it
    evicts only through a peer watch's key root (the lease keys it revokes)."""
    if ctx.cfg.nnodes < 2:
        return None
    store, node = cluster.store, ctx.cfg.node_rank
    root = cluster.watch.root if cluster.watch is not None else None

    def evict(far: int, how: str, t0: float) -> None:
        if root is not None:
            revoke_node(store, root, far, by=node, how=how, t0=t0)

    return LinkDetector(
        config=ctx.cfg.degraded,
        node=node,
        workers=workers,
        records=cluster,
        live=cluster.live_nodes,
        holder=lambda live: holder_node(store, root, live) if root is not None else min(live),
        evict=evict if root is not None else None,
        events=ctx.events,
        say=ctx.say,
    )
