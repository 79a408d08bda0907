"""The node agent behind `stalwart run`: spawn, watch, detect, recover.

One agent per node. It hosts the job's coordinator store (node 0, like torchrun's c10d
store), starts a zygote that forks every worker (first start, replacement, spare), reads
the progress board for hangs, fires the chaos plan's agent-side faults, and writes the
run's events. Workers get torchrun's environment, so a plain script runs unchanged;
workers that call ``stalwart.init()`` also get stalwart's part of their contract
(runtime/env.py) and recover in place (``flash``/``spare``), while plain scripts get
torchrun's restart-everything route.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from stalwart.agent._chaos_exec import AgentChaos
from stalwart.agent._cluster import Cluster
from stalwart.agent._elastic import elastic_env, elastic_recover, job_failure, pending_joins
from stalwart.agent._env import Worker, WorkerFields, WorkerSpec, error_message, spawn_spec
from stalwart.agent._fencing import NodeFenced, check_fenced, end_fenced
from stalwart.agent._incidents import HangWatch, adopt_lost_nodes, check_hang
from stalwart.agent._lifecycle import emit_run_start, preload_note, teardown
from stalwart.agent._replica import start_replicas
from stalwart.agent._rundir import claim_run_dir
from stalwart.agent._standby import start_standbys
from stalwart.agent._steps import StepRecords
from stalwart.agent._trash import Trash
from stalwart.agent._zygote_client import ZygoteClient
from stalwart.agent.config import LaunchConfig
from stalwart.agent.progress import ProgressBoard
from stalwart.agent.verdict import CrashLoops, Failure, error_line, failed_at
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.errors import StalwartError
from stalwart.metrics.events import EVENTS_FILE, EventLog

__all__ = ["Agent", "run_agent"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(f"stalwart: {msg}", file=sys.stderr, flush=True)


class Agent:
    def __init__(self, config: LaunchConfig) -> None:
        self.cfg = config
        self.run_dir = os.path.abspath(config.run_dir or os.path.join("runs", config.job))
        moved = claim_run_dir(self.run_dir, config.job)  # a reused --run-dir: rotated
        self.events = EventLog(os.path.join(self.run_dir, EVENTS_FILE), node=config.node_rank)
        if moved is not None:
            why = f"the previous run's records moved to {moved}; checkpoints stay in ckpt/"
            _say(f"{self.run_dir}: {why}")
            self.events.emit("note", message=why)
        self.ledger = FaultLedger(self.run_dir)
        self.trash = Trash()  # a lost node's /dev/shm, freed once we recovered
        self.plan = FaultPlan.parse(config.chaos)
        self.workers = {r: Worker(r, i, i) for i, r in enumerate(config.local_ranks)}
        self.restarts = 0
        self.generation = 0
        self.master_port = _free_port()
        self.spares: list[int] = []
        self._pending_spawn: dict[str, int] = {}
        self.cluster = Cluster(config, self.run_dir)
        self._zygote: ZygoteClient | None = None
        self._board: ProgressBoard | None = None
        self.status = "failed"
        self._t_recovery = 0.0
        self._goodbye = True
        self._live: Any = None
        self.standbys: Any = None
        self.step_records = StepRecords(self)  # what rank 0 could not write (_steps.py)
        self.hangs = HangWatch(config.hang)  # CPU trackers, the job's step-time history
        self.loops = CrashLoops(config.crash_loop_limit)

    # ---------------------------------------------------------------- setup
    def _start(self) -> None:
        cfg = self.cfg
        self.cluster.start()
        self.coord = self.cluster.coord
        self.generation = self.coord.generation()
        board = self.cluster.names.progress_board(cfg.node_rank)
        # room for every rank: a node may adopt the ranks of a lost node
        self._board = ProgressBoard(board, cfg.world_size, create=True)
        os.makedirs(os.path.join(self.run_dir, "chaos"), exist_ok=True)
        self.plan_path = os.path.join(self.run_dir, "chaos", "plan.json")
        if cfg.node_rank == 0:
            with open(self.plan_path, "w") as f:
                f.write(self.plan.to_json())
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        self._zygote = ZygoteClient(["stalwart.runtime.session"], env, script=cfg.script)
        ready = self._zygote.wait_for("ready", cfg.start_timeout_s)
        preload_note(self, ready)
        host = cfg.endpoint()[0]
        fqdn = socket.getfqdn()  # torchrun's MASTER_ADDR: node 0's host name
        if cfg.etcd:  # gloo groups form over etcd too (runtime/_c10d_store.py)
            self.cluster.publish_once(
                "c10d", {"addr": "", "master_port": self.master_port, "master_addr": fqdn}
            )
        elif cfg.node_rank == 0:
            self._zygote.send({"op": "store", "host": host})
            port = self._zygote.wait_for("store", 30)["port"]
            self.cluster.publish(
                "c10d",
                {"addr": f"{host}:{port}", "master_port": self.master_port, "master_addr": fqdn},
            )
        launch = self.cluster.read("c10d", cfg.start_timeout_s)
        self.c10d_addr = str(launch["addr"])
        self.master_port = int(launch["master_port"])
        self.master_addr = str(launch.get("master_addr") or host)
        self.chaos = AgentChaos(self, self.plan.agent_faults(cfg.node_rank, list(self.workers)))
        if cfg.node_rank == 0:
            self._emit_run_start(ready)
            if cfg.metrics_port is not None or cfg.progress:
                from stalwart.metrics.follow import start_live

                self._live = start_live(
                    self.run_dir,
                    metrics_port=cfg.metrics_port,
                    console=cfg.progress,
                    labels={"job": cfg.job},
                )
                for sink in self._live.sinks:
                    if hasattr(sink, "url"):
                        _say(f"metrics at {sink.url}")
            with open(os.path.join(self.run_dir, "agent.json"), "w") as f:
                json.dump({"job": cfg.job, "store": self.cluster.address, "pid": os.getpid()}, f)
        for _ in range(cfg.spares):
            self._prefork()
        self.replicas = start_replicas(self)
        self.standbys = start_standbys(self)

    def _emit_run_start(self, ready: dict[str, Any]) -> None:
        emit_run_start(self, ready)

    # ---------------------------------------------------------------- spawning
    def _spec(self, w: Worker) -> dict[str, Any]:
        return self.worker_spec(w, {})

    def worker_spec(self, w: Worker, extra: WorkerFields) -> dict[str, Any]:
        """What the zygote needs to start ``w`` (environment, argv, cwd, log file); a
        replacement inherits its rank's step-time history and reports its error."""
        spec = WorkerSpec(w.rank, w.local, w.slot)
        job: WorkerFields = {
            "step_p99_s": round(self.hangs.history.get(w.rank, 0.0), 6),
            "error_line": self.error_path(w.rank),
        }
        return spawn_spec(self, spec, {**elastic_env(self, w), **job, **extra})

    def error_path(self, rank: int) -> str:
        """Where a worker of ``rank`` leaves the first line of its error (the zygote)."""
        return os.path.join(self.run_dir, "errors", f"rank{rank}.txt")

    def _spawn(self, w: Worker) -> None:
        assert self._zygote is not None and self._board is not None
        self._board.clear(w.slot)
        w.state, w.cause, w.pid, w.t_spawn = "starting", "", 0, time.time()
        if self.cfg.strategy == "spare" and self.spares and self.generation > 0:
            spare = self.spares.pop(0)
            self._zygote.send({"op": "assign", "pid": spare, "spec": self._spec(w)})
            w.pid, w.state = spare, "running"
            self._prefork()
        else:
            self._pending_spawn[f"rank-{w.rank}"] = w.rank
            self._zygote.send({"op": "spawn", "id": f"rank-{w.rank}", "spec": self._spec(w)})
        self.emit_join(w)

    def emit_join(self, w: Worker, *, standby: bool = False) -> None:
        """``member_join`` for ``w`` at the current generation (``standby``: it runs in a
        parked standby process, agent/_standby.py)."""
        more = {"standby": True} if standby else {}
        self.events.emit(
            "member_join",
            member=f"rank{w.rank}",
            node=self.cfg.node_rank,
            rank=w.rank,
            generation=self.generation,
            **more,
        )

    def free_slot(self) -> int:
        """The lowest progress-board slot no worker or standby of this node holds."""
        used = {w.slot for w in self.workers.values()}
        if self.standbys is not None:
            used |= self.standbys.used_slots()
        return min(set(range(len(used) + 1)) - used)

    def _prefork(self) -> None:
        assert self._zygote is not None
        self._zygote.send({"op": "prefork", "id": "spare-pending"})

    # ---------------------------------------------------------------- events
    def _on_message(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "spawned":
            ident = str(msg["id"])
            if self.standbys is not None and self.standbys.on_spawned(ident, int(msg["pid"])):
                return
            if ident == "spare-pending":
                # a pre-forked spare: its pid is its name from now on
                self.spares.append(int(msg["pid"]))
                return
            rank = self._pending_spawn.pop(ident, None)
            if rank is not None:
                self.workers[rank].pid = int(msg["pid"])
                self.workers[rank].state = "running"
        elif op == "exit":
            self._on_exit(int(msg["pid"]), int(msg["rc"]), float(msg["t"]))

    def _by_pid(self, pid: int) -> Worker | None:
        return next((w for w in self.workers.values() if w.pid == pid), None)

    def _on_exit(self, pid: int, rc: int, t_exit: float) -> None:
        self.step_records.on_exit(pid)
        if self.standbys is not None and self.standbys.on_exit(pid):
            return  # a parked standby died: the next reconcile starts another
        w = self._by_pid(pid)
        if w is None or w.state in ("done", "dead"):
            return
        if rc == 0:
            w.state = "done"
            return
        w.state = "dead"
        if w.cause in ("restart", "shutdown"):
            return
        now = time.time()
        domain = {"rank": w.rank, "node": self.cfg.node_rank}
        err = None
        if w.cause != "hang":
            fired = self.ledger.fired_at(pid=pid)
            latency = now - (fired if fired is not None else t_exit)
            how = f"process exit (rc {rc})"
            if (err := error_message(self.run_dir, w.rank, pid)) is not None:
                how += f": {err}"  # what its @record wrote (TORCHELASTIC_ERROR_FILE)
            self.events.emit(
                "fault_detected", fault="crash", domain=domain, latency_s=latency, how=how
            )
            _say(f"rank {w.rank} crashed ({how}); detected in {latency * 1000:.0f} ms")
        self.events.emit(
            "member_leave",
            member=f"rank{w.rank}",
            node=self.cfg.node_rank,
            rank=w.rank,
            reason=w.cause or f"exit rc {rc}",
        )
        cause = w.cause or "crash"
        self._recover(w, cause=cause, loop=self._crash_loop(w, rc, cause, err))

    def _crash_loop(self, w: Worker, rc: int, cause: str, recorded: str | None) -> str | None:
        """Record the failure of ``w``; the verdict line when it keeps failing at the
        same point (agent/verdict.py). ``recorded``: what its ``@record`` wrote."""
        assert self._board is not None
        where = failed_at(self._board.read(w.slot), w.pid)
        error = error_line(self.error_path(w.rank), rc, self.hangs.killed.pop(w.pid, ""))
        error = recorded or error
        failure = Failure(w.rank, where, error, cause)
        self.last_failure = failure
        return self.loops.record(failure)

    def end_with_verdict(self, line: str) -> None:
        """End the job (every node: the verdict is published) with one line."""
        with contextlib.suppress(Exception):
            self.cluster.publish("verdict", {"line": line})
        _say(line)
        raise _RunFailed(line)

    def _published_verdict(self) -> None:
        kv = self.cluster.store.get(f"/stalwart/{self.cfg.job}/launch/verdict")
        if kv is not None:
            line = str(json.loads(kv.value)["line"])
            raise _RunFailed(line)

    # ---------------------------------------------------------------- recovery
    def _attached(self) -> bool:
        return all(w.attached for w in self.workers.values())

    def _bump(self, reason: str, *, must_win: bool = False) -> None:
        """Advance the generation; ``must_win``: until our own bump (with our reason) is
        the current one, even if a worker bumped first (a restart must be recognisable
        as one by the other agents, which read the reason)."""
        change = self.coord.advance_generation(self.generation, reason)
        while must_win and not change.won:
            change = self.coord.advance_generation(change.generation, reason)
        self.generation = change.generation
        self.events.emit(
            "generation", generation=self.generation, world_size=self.cfg.world_size, reason=reason
        )

    def _recover(self, failed: Worker, cause: str, loop: str | None = None) -> None:
        """``loop``: the crash-loop verdict, when ``failed`` keeps failing at one point."""
        cfg = self.cfg
        check_fenced(self, probe=True)  # our ranks may run elsewhere now
        self._t_recovery = time.time()
        # plain scripts (no stalwart runtime) cannot re-form in place: torchrun's route
        strategy = cfg.strategy if self._attached() else "restart"
        if strategy == "elastic":
            if (why := job_failure(self)) is not None:
                _say(why)
                raise _RunFailed(why)
            elastic_recover(self, failed, cause, loop)
            return
        if loop is not None:  # it would fail the same way again, whatever the strategy
            self.end_with_verdict(loop)
        member = f"rank{failed.rank}"
        if strategy != "restart" and self.coord.record_failure(member, cause):
            # never readmitted: in place, the same slot would fail again
            self.events.emit("isolation", member=member, reason=cause, blocklisted=True)
            entry = self.coord.blocklisted().get(member)
            last = getattr(self, "last_failure", None)
            at = f" at {last.where}: {last.error}" if last is not None else ""
            self.end_with_verdict(
                f"rank {failed.rank} blocklisted ({entry.reason if entry else cause}{at}); "
                f"the job ends: fix what makes rank {failed.rank} fail (see its log) and "
                "resume from the last checkpoint"
            )
        node = f"node{cfg.node_rank}"
        if strategy != "restart" and cfg.node_rank != 0 and self.coord.record_failure(node, cause):
            # this machine keeps failing: take it out; node 0 adopts its ranks
            self.coord.block(node, f"cordoned after repeated failures, last: {cause}")
            self.events.emit("isolation", member=node, reason=cause, blocklisted=True)
            _say(f"node {cfg.node_rank} failed too often: cordoned, its ranks move to node 0")
            raise _Cordoned(f"node {cfg.node_rank} cordoned")
        if strategy == "restart":
            if self.restarts >= cfg.max_restarts:
                _say(f"rank {failed.rank} failed and --max-restarts={cfg.max_restarts} is spent")
                raise _RunFailed(f"rank {failed.rank} failed ({cause}); no restarts left")
            self._restart_all(f"{cause} of rank {failed.rank}", cause)
            return
        self._bump(f"{cause} of rank {failed.rank}")
        self.events.emit(
            "recovery_begin", strategy=strategy, generation=self.generation, cause=cause
        )
        self._spawn(failed)

    def _restart_all(self, what: str, cause: str) -> None:
        """torchrun's route for the whole job: every node restarts its workers."""
        if self.restarts >= self.cfg.max_restarts:
            _say(f"{what}: --max-restarts={self.cfg.max_restarts} is spent")
            raise _RunFailed(f"{what}; no restarts left")
        self.cluster.publish("last-done", {"step": self.last_step() or 0})
        self.master_port = _free_port()
        self._bump(f"restart after {what}", must_win=True)
        self.cluster.publish(f"master-{self.generation}", {"port": self.master_port})
        self.events.emit(
            "recovery_begin", strategy="restart", generation=self.generation, cause=cause
        )
        self._restart_local()

    def _restart_local(self) -> None:
        """torchrun's route: every local worker is killed and started again (standbys
        too: they belong to the killed launch; the next reconcile starts new ones)."""
        if self.standbys is not None:
            self.standbys.close()
        self.restarts += 1
        self._stop_all("restart")
        _say(f"restarting all workers (restart {self.restarts}/{self.cfg.max_restarts})")
        for w in self.workers.values():
            self._spawn(w)

    def _follow_generation(self) -> None:
        """Another node bumped the generation: restart here too if it was a restart."""
        gen = self.coord.generation()
        if gen <= self.generation:
            return
        self.generation = gen
        if str(self.coord.generation_meta().get("reason", "")).startswith("restart"):
            if self.restarts >= self.cfg.max_restarts:
                raise _RunFailed("another node restarted the job and no restarts are left")
            self.master_port = int(self.cluster.read(f"master-{gen}", 30)["port"])
            self._restart_local()

    @staticmethod
    def new_worker(rank: int, local: int, slot: int, *, attached: bool) -> Worker:
        return Worker(rank, local, slot, attached=attached)

    @staticmethod
    def say(msg: str) -> None:
        _say(msg)

    def _stop_all(self, cause: str, timeout: float = 10.0) -> None:
        """SIGKILL every live local worker and wait until the zygote reaped them."""
        assert self._zygote is not None
        live = [w for w in self.workers.values() if w.state in ("running", "starting") and w.pid]
        for w in live:
            w.cause = cause
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while any(w.state not in ("dead", "done") for w in live):
            if time.monotonic() > deadline:
                break
            for msg in self._zygote.events(0.05):
                self._on_message(msg)

    # ---------------------------------------------------------------- monitor
    def run(self) -> int:
        try:
            self._start()
        except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM while starting
            return self._interrupted(err)
        assert self._zygote is not None
        last_poll = 0.0
        try:
            for w in self.workers.values():
                self._spawn(w)
            while True:
                wake = self.cluster.wake_fd()  # a watched peer died: poll the store now
                for msg in self._zygote.events(self.cfg.monitor_interval_s, wake):
                    self._on_message(msg)
                if all(w.state in ("done", "gone") for w in self.workers.values()) and not (
                    self.cfg.strategy == "elastic" and pending_joins(self)
                ):
                    self.status = "ok"
                    return 0
                now = time.time()
                check_hang(self, now)
                self.step_records.tick(now)
                if self.trash.pending:  # (the board is read only then)
                    self.trash.collect(recovered=self._recovered())
                self.chaos.tick(now)
                # store round trips: a few per second, or at once after a peer died
                if now - last_poll > 0.1 or self.cluster.peer_gone():
                    last_poll = now
                    check_fenced(self, probe=False)
                    self._published_verdict()  # another node ended the job
                    adopt_lost_nodes(self)
                    self._follow_generation()
                    self.chaos.poll_requests()
                    if self.standbys is not None:
                        self.standbys.reconcile(now)
        except NodeFenced as err:
            end_fenced(self, err)
            self.status, self._end_reason, self._goodbye = "fenced", str(err), False
            return 3
        except _Cordoned as err:
            self.status, self._end_reason, self._goodbye = "cordoned", str(err), False
            return 3
        except _RunFailed as err:
            self._end_reason = str(err)
            return 1
        except KeyboardInterrupt as err:
            return self._interrupted(err)

    def _interrupted(self, err: KeyboardInterrupt) -> int:
        """Ctrl-C (130) or SIGTERM (143): the teardown still ends every worker, writes
        ``run_end`` and removes the shared memory."""
        term = isinstance(err, _Terminated)
        self.status = "terminated" if term else "interrupted"
        self._end_reason = "SIGTERM" if term else "SIGINT (Ctrl-C)"
        return 143 if term else 130

    def _recovered(self) -> bool:
        """Every running worker of this node is in the current generation, past its
        recovery (read from the progress board: no store round trip)."""
        if self._board is None:
            return True
        for w in self.workers.values():
            if w.state != "running":
                continue
            slot = self._board.read(w.slot)
            if slot.generation < self.generation or slot.phase not in _TRAINING:
                return False
        return True

    def last_step(self) -> int | None:
        if self._board is None:
            return None
        steps = [self._board.read(w.slot).step for w in self.workers.values()]
        return max(steps) if steps else None

    def close(self) -> None:
        teardown(self)


_TRAINING = ("step", "collective", "done")


class _RunFailed(StalwartError):
    pass


class _Cordoned(StalwartError):
    pass


class _Terminated(KeyboardInterrupt):
    """SIGTERM: the run ends like after Ctrl-C, with 143 (128 + SIGTERM)."""


def _terminate(signum: int, _frame: object) -> None:
    raise _Terminated


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
