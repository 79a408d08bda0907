"""The node agent behind `stalwart run`: it wires the parts and runs the loop.

One agent per node. It hosts the job's coordinator store (node 0, like torchrun's c10d
store), starts a zygote that forks every worker (first start, replacement, spare), reads
the progress board for hangs, fires the chaos plan's agent-side faults, and writes the
run's events. Workers get torchrun's environment, so a plain script runs unchanged;
workers that call ``stalwart.init()`` also get ``STALWART_*`` variables and recover by
the job's strategy, while plain scripts get torchrun's restart-everything route.

The parts, each the owner of its state: :class:`~stalwart.agent._workers.LocalWorkers`
(processes, spares, zygote, board), :class:`~stalwart.agent._generation.JobGeneration`
(generation, restarts, port), the detectors (agent/_detectors.py: typed incidents), the
:class:`~stalwart.agent.policy.RecoveryPolicy` of ``--strategy``, the cluster
(membership, leases, fencing). Teardown is one ``ExitStack``: each part's end is
registered when the part is set up (agent/_lifecycle.py says why the order matters).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable

from stalwart.agent._chaos_exec import AgentChaos
from stalwart.agent._cluster import Cluster, NodeFenced
from stalwart.agent._detectors import CrashDetector, HangDetector, HangWatch, NodeLossDetector
from stalwart.agent._elastic import Joins
from stalwart.agent._generation import JobGeneration
from stalwart.agent._lifecycle import (
    WorkerSpecs,
    clean_shm,
    emit_run_start,
    exchange_c10d,
    preload_note,
    write_agent_json,
)
from stalwart.agent._outcome import Cordoned, RunFailed, Terminated
from stalwart.agent._policies import choose_policy
from stalwart.agent._replica import NodeReplicas
from stalwart.agent._restart import RestartAll
from stalwart.agent._rundir import claim_run_dir
from stalwart.agent._standby import Standbys
from stalwart.agent._steps import StepRecords
from stalwart.agent._trash import Trash
from stalwart.agent._workers import LocalWorkers
from stalwart.agent._zygote_client import ZygoteClient
from stalwart.agent.config import LaunchConfig
from stalwart.agent.incidents import Incident, NodeLost
from stalwart.agent.policy import RecoveryParts, RecoveryPolicy
from stalwart.agent.progress import ProgressBoard
from stalwart.agent.verdict import CrashLoops
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.metrics.events import EVENTS_FILE, EventLog

__all__ = ["Agent", "run_agent"]


def _say(msg: str) -> None:
    print(f"stalwart: {msg}", file=sys.stderr, flush=True)


def _quietly(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    return run


class Agent:
    def __init__(self, config: LaunchConfig) -> None:
        self.cfg = config
        self.run_dir = os.path.abspath(config.run_dir or os.path.join("runs", config.job))
        moved = claim_run_dir(self.run_dir, config.job)  # a reused --run-dir: rotated
        self.events = EventLog(os.path.join(self.run_dir, EVENTS_FILE), node=config.node_rank)
        self._stack = contextlib.ExitStack()
        self._stack.callback(self.events.close)
        if moved is not None:
            why = f"the previous run's records moved to {moved}; checkpoints stay in ckpt/"
            _say(f"{self.run_dir}: {why}")
            self.events.emit("note", message=why)
        self.ledger = FaultLedger(self.run_dir)
        self.plan = FaultPlan.parse(config.chaos)
        self.cluster = Cluster(config, self.run_dir)
        self.hangs = HangWatch(config.hang)  # CPU trackers, the job's step-time history
        self.status, self._end_reason, self._goodbye = "failed", "", True
        self._ranks: Callable[[], list[int]] = list  # slots to remove (none until joined)

    # ---------------------------------------------------------------- setup
    def _start(self) -> None:
        cfg, stack, cluster = self.cfg, self._stack, self.cluster
        stack.callback(self._clean_shm)
        cluster.start()
        # a member's ranks are its own only once it joined (the job may refuse it)
        self._ranks = lambda: cfg.local_ranks
        stack.callback(lambda: cluster.close(goodbye=self._goodbye))
        board_path = cluster.names.progress_board(cfg.node_rank)
        # room for every rank: a node may adopt the ranks of a lost node
        board = ProgressBoard(board_path, cfg.world_size, create=True)
        stack.callback(board.close, unlink=True)
        self.gen = JobGeneration(cluster.coord, cluster, self.events, cfg.world_size)
        self.gen.sync()
        os.makedirs(os.path.join(self.run_dir, "chaos"), exist_ok=True)
        plan_path = os.path.join(self.run_dir, "chaos", "plan.json")
        if cfg.node_rank == 0:
            with open(plan_path, "w") as f:
                f.write(self.plan.to_json())
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        zygote = ZygoteClient(["stalwart.runtime.session"], env, script=cfg.script)
        stack.callback(zygote.close)
        ready = zygote.wait_for("ready", cfg.start_timeout_s)
        preload_note(cfg, ready, _say)
        c10d = exchange_c10d(cfg, cluster, zygote, self.gen.master_port)
        self.gen.use_port(c10d.master_port)
        self.workers = workers = LocalWorkers(cfg.local_ranks, board, zygote)
        self._ranks = workers.ranks
        if cfg.node_rank == 0:
            emit_run_start(self.events, cfg, ready, self.gen.current)
            self._start_live()
            write_agent_json(self.run_dir, cfg.job, cluster.address)
        self._wire_recovery(workers)
        self.specs = WorkerSpecs(
            cfg, self.run_dir, cluster, c10d, (board_path, plan_path), self.gen,
            self.hangs.history, self.policy.worker_env,
        )  # fmt: skip
        workers.wire(self.specs, self.parts.joined, assign_spares=self.policy.assigns_spares)
        steps = StepRecords(
            names=cluster.names,
            events=self.events,
            workers=workers,
            generation=lambda: self.gen.current,
            strategy=cfg.strategy,
        )  # fmt: skip  (what rank 0 could not write, agent/_steps.py)
        workers.on_any_exit(steps.on_exit)
        self.steps = steps
        stack.callback(self._run_end)
        stack.callback(_quietly(steps.close))  # before run_end: the last steps belong to it
        self.chaos = AgentChaos(
            self.plan.agent_faults(cfg.node_rank, workers.ranks()),
            node=cfg.node_rank, answerable=self.plan.home_faults(cfg.node_rank, cfg.nproc_per_node),
            run_dir=self.run_dir, workers=workers, events=self.events, ledger=self.ledger,
            join=self.joins.fire, kill_node=workers.kill_node,
        )  # fmt: skip
        self.joins.follow(self.chaos.pending_faults)
        stack.callback(_quietly(self.chaos.report_unfired))  # a warning per unfired fault
        for _ in range(cfg.spares):
            workers.prefork()
        if cfg.replica_rate_mb_s > 0:
            replicas = NodeReplicas(
                cluster, workers.ranks, self._note, host=cfg.replica_host,
                rate_bytes_per_s=cfg.replica_rate_mb_s * 1e6,
            )  # fmt: skip
            stack.callback(replicas.close)
            self.replicas: NodeReplicas | None = replicas
        self.trash = Trash()  # a lost node's /dev/shm, freed once we recovered
        stack.callback(self.trash.close)
        if self.standbys is not None:
            stack.callback(self.standbys.close)
            workers.watch(self.standbys)
        stack.callback(_quietly(lambda: workers.stop_all("shutdown", timeout=5.0)))

    def _wire_recovery(self, workers: LocalWorkers) -> None:
        cfg, cluster = self.cfg, self.cluster
        self.replicas = None
        self.standbys: Standbys | None = None
        if cfg.standby:
            self.standbys = Standbys(
                node=cfg.node_rank, nproc=cfg.nproc_per_node, names=cluster.names, ring=cluster,
                workers=workers, spec=lambda w, extra: self.specs(w, extra),
            )  # fmt: skip
        self.parts = RecoveryParts(
            cfg, workers, self.gen, cluster.coord, cluster, self.events, self.ledger,
            self.standbys, _say,
        )  # fmt: skip
        self.joins = Joins(self.parts)
        self.policy: RecoveryPolicy = choose_policy(cfg.strategy, self.parts, self.joins)
        self.restart = RestartAll(self.parts)  # a plain script's route, and a followed restart
        node, ledger, events = cfg.node_rank, self.ledger, self.events
        self.crashes = CrashDetector(
            node=node, run_dir=self.run_dir, workers=workers, hangs=self.hangs,
            loops=CrashLoops(cfg.crash_loop_limit), ledger=ledger, events=events, say=_say,
        )  # fmt: skip
        self.hang = HangDetector(
            config=cfg.hang, node=node, whole_job=cfg.nnodes == 1, workers=workers,
            watch=self.hangs, ledger=ledger, events=events, say=_say,
        )  # fmt: skip
        self.lost = NodeLossDetector(
            nodes=cluster, lease_s=cfg.node_lease_s, ledger=ledger, events=events, say=_say
        )

    def _start_live(self) -> None:
        cfg = self.cfg
        if cfg.metrics_port is None and not cfg.progress:
            return
        from stalwart.metrics.follow import start_live

        live = start_live(
            self.run_dir, metrics_port=cfg.metrics_port, console=cfg.progress,
            labels={"job": cfg.job},
        )  # fmt: skip
        self._stack.callback(_quietly(live.close))
        for sink in live.sinks:
            if hasattr(sink, "url"):
                _say(f"metrics at {sink.url}")

    def _note(self, why: str) -> None:
        _say(why)
        self.events.emit("note", message=why)

    # ---------------------------------------------------------------- incidents
    def _recover(self, incident: Incident) -> None:
        if isinstance(incident, NodeLost):
            self.hang.recovery_began(time.time())
            self._adopt(incident)
        else:
            self.cluster.check_fenced(probe=True)  # our ranks may run elsewhere now
            self.hang.recovery_began(time.time())
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
            self.events.emit(
                "note",
                message=f"ranks {sorted(taken)} of node {lost.node} take over their replicas "
                f"(steps {sorted(set(taken.values()))}) from this node's memory",
            )

    # ---------------------------------------------------------------- monitor
    def run(self) -> int:
        try:
            self._start()
            for w in self.workers:
                self.parts.spawn(w)
            self._loop()
        except NodeFenced as err:
            self._fenced(err)
            self.status, self._end_reason, self._goodbye = "fenced", str(err), False
            return 3
        except Cordoned as err:
            self.status, self._end_reason, self._goodbye = "cordoned", str(err), False
            return 3
        except RunFailed as err:
            self._end_reason = str(err)
            return 1
        except KeyboardInterrupt as err:  # Ctrl-C (130) or SIGTERM (143)
            term = isinstance(err, Terminated)
            self.status = "terminated" if term else "interrupted"
            self._end_reason = "SIGTERM" if term else "SIGINT (Ctrl-C)"
            return 143 if term else 130
        self.status = "ok"
        return 0

    def _loop(self) -> None:
        workers, last_poll = self.workers, 0.0
        while True:
            wake = self.cluster.wake_fd()  # a watched peer died: poll the store now
            for exit_ in workers.poll(self.cfg.monitor_interval_s, wake):
                self._recover(self.crashes.examine(exit_))
            if workers.finished() and not self.policy.keeps_running():
                return
            now = time.time()
            gen = self.gen.current if self.policy.judges_generation else None
            for hung in self.hang.check(now, generation=gen, slowed=self.chaos.slowed()):
                self.hang.isolate(hung)
            self.steps.tick(now)
            if self.trash.pending:  # (the board is read only then)
                self.trash.collect(recovered=workers.recovered(self.gen.current))
            self.chaos.tick(now)
            # store round trips: a few per second, or at once after a peer died
            if now - last_poll > 0.1 or self.cluster.peer_gone():
                last_poll = now
                self._poll_store(now)

    def _poll_store(self, now: float) -> None:
        self.cluster.check_fenced(probe=False)
        if (line := self.cluster.published_verdict()) is not None:
            raise RunFailed(line)  # another node ended the job
        for lost in self.lost.check():
            self._recover(lost)
        followed = self.gen.follow()
        if followed is not None and followed.restart:
            self.restart.follow()
        self.chaos.poll_requests()
        if self.standbys is not None:
            self.standbys.reconcile(now)

    def _fenced(self, err: NodeFenced) -> None:
        """Stop every local worker, forget the ranks another node on this host runs now
        (close() must not delete their snapshot slots), and record the isolation."""
        self.workers.reap_vanished()  # exits already reaped (their events may be lost)
        self.workers.stop_all("shutdown")  # "shutdown": their exits are not failures
        with contextlib.suppress(Exception):
            self.workers.forget(self.cluster.adopted_here())
        self.events.emit(
            "isolation", member=f"node{self.cfg.node_rank}", reason=str(err), blocklisted=False
        )
        _say(str(err))

    def _run_end(self) -> None:
        if self.cluster.reports_end():
            last = self.workers.last_step()
            self.events.emit("run_end", status=self.status, last_step=last, reason=self._end_reason)

    def _clean_shm(self) -> None:
        names = self.cluster.names if self.cluster.started else None
        clean_shm(names, self._ranks(), self.cluster.last_out)

    def close(self) -> None:
        self._stack.close()


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated


def run_agent(config: LaunchConfig) -> int:
    """Run one node's agent to the end of the job; returns the exit code."""
    import threading

    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.signal(signal.SIGTERM, _terminate)
    agent = Agent(config)
    try:
        return agent.run()
    finally:
        if main:  # a second Ctrl-C must not cut the teardown short (shared memory left)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        agent.close()
