"""The node agent behind `stalwart run`: it wires the parts and runs the loop.

One agent per node. It hosts the job's coordinator store (node 0, like torchrun's c10d
store), starts a zygote that forks every worker, reads the progress board for hangs,
fires the chaos plan's agent-side faults and writes the run's events. Workers get
torchrun's environment (a plain script runs unchanged, restarted torchrun's way); with
``stalwart.init()`` stalwart's contract too (contract/env.py), recovering by the strategy.

The parts, each the owner of its state, each a sub-package: the worker processes
(processes/: ``LocalWorkers``, spares, zygote, board), the detectors (detection/: typed
incidents), the ``RecoveryPolicy`` of ``--strategy`` (strategies/), the cluster
(cluster/: store, membership, leases, fencing, the ``JobGeneration``), the node's health
(health/) and the run directory (rundir/). Teardown is one ``ExitStack``: each
part's end is registered when the part is set up.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from stalwart.agent._lifecycle import (
    WorkerSpecs,
    clean_shm,
    emit_run_end,
    emit_run_start,
    launch,
    start_live,
    write_agent_json,
)
from stalwart.agent._outcome import (
    ENDINGS,
    RunFailed,
    ending,
    ignore_signals,
    quietly,
    signals_of_a_run,
)
from stalwart.agent._types import NodeContext
from stalwart.agent.cluster._cluster import Cluster, NodeFenced
from stalwart.agent.cluster._grace import noting
from stalwart.agent.cluster._replica import NodeReplicas
from stalwart.agent.config import LaunchConfig
from stalwart.agent.detection._detectors import Detectors, HangWatch
from stalwart.agent.detection.incidents import Incident, NodeLost
from stalwart.agent.health._node import NodeHealth
from stalwart.agent.health.endpoint import NodeStatus, serve_health
from stalwart.agent.processes._chaos import AgentChaos
from stalwart.agent.processes._standby import Standbys
from stalwart.agent.processes._steps import StepRecords
from stalwart.agent.processes._trash import Trash
from stalwart.agent.processes._workers import LocalWorkers
from stalwart.agent.rundir._claim import claim_run_dir
from stalwart.agent.strategies import choose_policy
from stalwart.agent.strategies._elastic import Joins
from stalwart.agent.strategies._restart import RestartAll
from stalwart.agent.strategies.policy import RecoveryParts, RecoveryPolicy
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.logs import get_logger
from stalwart.metrics.events import EVENTS_FILE, EventLog

__all__ = ["Agent", "run_agent"]

_log = get_logger(__name__)
_say: Callable[[str], None] = _log.info  # "stalwart: agent: ..."; the end: _outcome.py


class Agent:
    specs: WorkerSpecs  # what the zygote is told to start a worker with

    def __init__(self, config: LaunchConfig) -> None:
        self._launch_t = time.time()  # the report's wall time starts here (run_start)
        self.cfg = config
        self.run_dir = os.path.abspath(config.run_dir or os.path.join("runs", config.job))
        moved = claim_run_dir(self.run_dir, config.job)  # a reused --run-dir: rotated
        self.events = EventLog(os.path.join(self.run_dir, EVENTS_FILE), node=config.node_rank)
        self._stack = contextlib.ExitStack()  # each part's end, in the order it must run
        self._stack.callback(self.events.close)
        if moved is not None:
            why = f"the previous run's records moved to {moved}; checkpoints stay in ckpt/"
            _say(f"{self.run_dir}: {why}")
            self.events.emit("note", message=why)
        self.ledger = FaultLedger(self.run_dir)
        self.plan = FaultPlan.parse(config.chaos)
        self.cluster = Cluster(config, self.run_dir, noting(self.events, _say))  # _grace.py
        self.ctx = NodeContext(config, self.run_dir, self.events, self.ledger, _say)
        self.hangs = HangWatch(config.hang)  # CPU trackers, the job's step-time history
        self.node_status = NodeStatus(config.node_rank)  # /healthz, /readyz
        self.status, self._end_reason, self._goodbye = "failed", "", True
        self._ranks: Callable[[], list[int]] = lambda: config.local_ranks  # slots to remove

    # ---------------------------------------------------------------- setup
    def _start(self) -> None:
        cfg, ctx, stack, cluster = self.cfg, self.ctx, self._stack, self.cluster
        stack.callback(serve_health(cfg.health, self.node_status, _say))
        stack.callback(lambda: clean_shm(cluster, self._ranks()))
        goodbye = lambda: self._goodbye  # noqa: E731 (read when the cluster closes)
        up = launch(ctx, self.plan, cluster, stack, goodbye=goodbye)
        self.gen = up.generation  # over the cluster's coordinator (cluster/_generation.py)
        stack.callback(self.gen.started(up.c10d.master_port))  # its watch's end
        self.workers = workers = LocalWorkers(cfg.local_ranks, up.board, up.zygote)
        self._ranks = workers.ranks
        if cfg.node_rank == 0:
            emit_run_start(self.events, cfg, up.ready, self.gen.current, self._launch_t)
            stack.callback(quietly(start_live(cfg, self.run_dir, _say)))  # after run_end
            write_agent_json(self.run_dir, cfg.job, cluster.address)
        spec = lambda w, extra: self.specs(w, extra)  # noqa: E731 (built below)
        self.standbys = Standbys.for_node(cfg, cluster.names, cluster, workers, spec)
        self.parts = parts = RecoveryParts.of(ctx, workers, self.gen, cluster, self.standbys)
        self.joins = Joins(parts)
        self.policy: RecoveryPolicy = choose_policy(cfg.strategy, parts, self.joins)
        self.restart = RestartAll(parts)  # a plain script's route, and a followed restart
        self.detect = Detectors.for_node(ctx, workers, self.hangs, cluster)
        env = self.policy.worker_env
        self.specs = WorkerSpecs(ctx, cluster, up, self.gen, self.hangs.history, env)
        workers.wire(self.specs, parts.joined, assign_spares=self.policy.assigns_spares)
        self._start_watchers()

    def _start_watchers(self) -> None:
        """What watches and serves the workers besides the detectors; on the stack so
        that they end first (the workers first of all: registered last)."""
        ctx, stack, workers, names = self.ctx, self._stack, self.workers, self.cluster.names
        self.steps = StepRecords.for_node(ctx, names, workers, lambda: self.gen.current)
        workers.on_any_exit(self.steps.on_exit)  # what rank 0 could not write (_steps.py)
        stack.callback(self._run_end)
        stack.callback(quietly(self.steps.close))  # before run_end: the last steps are its
        self.chaos = AgentChaos.for_node(
            ctx, self.plan, workers, join=self.joins.fire, kill_node=workers.kill_node
        )
        self.joins.follow(self.chaos.pending_faults)
        stack.callback(quietly(self.chaos.report_unfired))  # a warning per unfired fault
        stack.callback(self.chaos.close)  # slowed processes left running
        for _ in range(self.cfg.spares):
            workers.prefork()
        self.replicas = NodeReplicas.for_node(ctx, self.cluster, workers.ranks)
        if self.replicas is not None:
            stack.callback(self.replicas.close)
        self.health = NodeHealth(ctx, self.cluster, workers)
        stack.callback(self.health.close)
        self.trash = Trash()  # a lost node's /dev/shm, freed once we recovered
        stack.callback(self.trash.close)
        if self.standbys is not None:
            stack.callback(self.standbys.close)
            workers.watch(self.standbys)
        stack.callback(quietly(lambda: workers.stop_all("shutdown", timeout=5.0)))

    # ---------------------------------------------------------------- incidents
    def _recover(self, incident: Incident) -> None:
        self.detect.recovery_began(time.time())
        if isinstance(incident, NodeLost):
            self._adopt(incident)
        else:
            self.cluster.check_fenced(probe=True)  # our ranks may run elsewhere now
        # plain scripts (no stalwart runtime) cannot re-form in place: torchrun's route
        policy = self.policy if self.workers.attached() else self.restart
        policy.on_incident(incident)

    def _adopt(self, lost: NodeLost) -> None:
        """Take over the lost node's ranks (their memory is gone: they restore from a
        peer's snapshot, or from this node's replica of theirs)."""
        workers, cfg = self.workers, self.cfg
        for rank in lost.ranks:
            self.trash.add(self.cluster.names.rank_dir(rank))
            if self.standbys is None or self.standbys.claim(rank) is None:
                local = rank % cfg.nproc_per_node  # an adopted rank keeps its LOCAL_RANK
                workers.adopt(rank, local, workers.free_slot())
        self.cluster.publish_ranks(workers.ranks())
        taken = self.replicas.take_over(list(lost.ranks)) if self.replicas else {}
        if taken:
            steps = sorted(set(taken.values()))
            why = f"ranks {sorted(taken)} of node {lost.node} take over their replicas"
            self.events.emit("note", message=f"{why} (steps {steps}) from this node's memory")

    # ---------------------------------------------------------------- monitor
    def run(self) -> int:
        try:
            self._start()
            if self.cfg.preflight:
                self.health.preflight()
            for w in self.workers:
                self.parts.spawn(w)
            self._loop()
        except ENDINGS as caught:
            err = self.cluster.fenced_if_cut(caught)  # no coordinator: fenced (exit 3)
            if isinstance(err, NodeFenced):  # said first: then its workers are stopped
                me = f"node{self.cfg.node_rank}"
                self.events.emit("isolation", member=me, reason=str(err), blocklisted=False)
                _say(str(err))
                self.workers.fence_out(self.cluster.adopted_here)
            end = ending(err)
            self.status, self._end_reason, self._goodbye = end.status, end.reason, end.goodbye
            return end.code
        self.status = "ok"
        return 0

    def _loop(self) -> None:
        workers, last_poll = self.workers, 0.0
        while True:
            self.node_status.tick()
            wake = self.cluster.wake_fd()  # a watched peer died: poll the store now
            for exit_ in workers.poll(self.cfg.monitor_interval_s, wake):
                self._recover(self.detect.crashes.examine(exit_))
            if workers.finished() and not self.policy.keeps_running():
                return
            now = time.time()
            gen = self.gen.current if self.policy.judges_generation else None
            self.detect.watch_progress(now, gen, self.chaos.slowed())
            self.steps.tick(now)
            if self.trash.pending:  # (the board is read only then)
                self.trash.collect(recovered=workers.recovered(self.gen.current))
            self.chaos.tick(now)
            # store round trips: a few per second, or at once after a peer died
            if now - last_poll > 0.1 or self.cluster.peer_gone():
                last_poll = now
                self._poll_store(now)

    def _poll_store(self, now: float) -> None:
        self.cluster.check_fenced(probe=False)  # (a missing lease: rejoins, cluster/_grace.py)
        self.health.check()
        if (line := self.cluster.published_verdict()) is not None:
            raise RunFailed(line)  # another node ended the job
        for lost in self.detect.lost.check():
            self._recover(lost)
        followed = self.gen.follow()
        if followed is not None and followed.restart:
            self.restart.follow()
        self.chaos.poll_requests()
        if self.standbys is not None:
            self.standbys.reconcile(now)

    def _run_end(self) -> None:
        emit_run_end(self.ctx, self.cluster, self.workers.last_step, self.status, self._end_reason)

    def close(self) -> None:
        self.node_status.ending()
        self._stack.close()


def run_agent(config: LaunchConfig) -> int:
    """Run one node's agent to the end of the job; returns the exit code."""
    with signals_of_a_run() as saved:
        agent = Agent(config)
        try:
            return agent.run()
        finally:
            ignore_signals(saved)
            agent.close()
