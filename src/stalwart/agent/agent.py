"""The node agent behind `stalwart run`: spawn, watch, detect, recover.

One agent per node. It hosts the job's coordinator store (node 0, like torchrun's c10d
store), starts a zygote that forks every worker (first start, replacement, spare), reads
the progress board for hangs, fires the chaos plan's agent-side faults, and writes the
run's events. Workers get torchrun's environment, so a plain script runs unchanged;
workers that call ``stalwart.init()`` also get ``STALWART_*`` variables and recover in
place (``flash``/``spare``), while plain scripts get torchrun's restart-everything route.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from stalwart.agent._chaos_exec import AgentChaos
from stalwart.agent._zygote_client import ZygoteClient
from stalwart.agent.config import LaunchConfig
from stalwart.agent.detect import find_hang
from stalwart.agent.progress import ProgressBoard
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.coordinator import (
    Coordinator,
    CoordinatorConfig,
    StoreServer,
    StoreServerConfig,
    create_token_file,
)
from stalwart.errors import StalwartError
from stalwart.metrics.events import EVENTS_FILE, EventLog

__all__ = ["Agent", "run_agent"]


@dataclass
class _Worker:
    rank: int
    local: int
    pid: int = 0
    state: str = "starting"  # starting | running | done | dead
    cause: str = ""  # why the agent killed it: hang | restart | chaos | shutdown
    attached: bool = False  # its script runs the stalwart runtime (sticky across restarts)
    t_spawn: float = 0.0


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
        os.makedirs(self.run_dir, exist_ok=True)
        self.events = EventLog(os.path.join(self.run_dir, EVENTS_FILE), node=config.node_rank)
        self.ledger = FaultLedger(self.run_dir)
        self.plan = FaultPlan.parse(config.chaos)
        self.workers = {r: _Worker(r, i) for i, r in enumerate(config.local_ranks)}
        self.restarts = 0
        self.generation = 0
        self.master_port = _free_port()
        self.spares: list[int] = []
        self._pending_spawn: dict[str, int] = {}
        self._server: StoreServer | None = None
        self._zygote: ZygoteClient | None = None
        self._board: ProgressBoard | None = None
        self._t0 = time.time()
        self.status = "failed"
        self._t_recovery = 0.0

    # ---------------------------------------------------------------- setup
    def _start(self) -> None:
        cfg = self.cfg
        token_path = cfg.token_file or os.path.join(self.run_dir, "token")
        if cfg.node_rank == 0 and not os.path.exists(token_path):
            create_token_file(token_path)
        self.token_file = token_path
        with open(token_path, "rb") as f:
            token = f.read().strip()
        host, port = cfg.endpoint()
        self._server = StoreServer(token, StoreServerConfig(host=host, port=port)).start()
        self.store_addr = f"{host}:{self._server.port}"
        self.coord = Coordinator(
            self._server.store,
            CoordinatorConfig(
                job_id=cfg.job, lease_ttl=cfg.node_lease_s, heartbeat_interval=cfg.node_lease_s / 3
            ),
        )
        self.generation = self.coord.generation()
        board = f"/dev/shm/stalwart-{cfg.job}-progress-n{cfg.node_rank}"
        self._board = ProgressBoard(board, len(self.workers), create=True)
        os.makedirs(os.path.join(self.run_dir, "chaos"), exist_ok=True)
        self.plan_path = os.path.join(self.run_dir, "chaos", "plan.json")
        with open(self.plan_path, "w") as f:
            f.write(self.plan.to_json())
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        self._zygote = ZygoteClient(["stalwart.runtime.session"], env)
        ready = self._zygote.wait_for("ready", cfg.start_timeout_s)
        self._zygote.send({"op": "store", "host": "127.0.0.1"})
        self.c10d_addr = f"127.0.0.1:{self._zygote.wait_for('store', 30)['port']}"
        self.chaos = AgentChaos(self, self.plan.agent_faults(cfg.node_rank, list(self.workers)))
        self.events.emit(
            "run_start",
            job=cfg.job,
            world_size=cfg.world_size,
            nnodes=cfg.nnodes,
            strategy=cfg.strategy,
            config={
                "script": cfg.script,
                "nproc_per_node": cfg.nproc_per_node,
                "max_restarts": cfg.max_restarts,
                "spares": cfg.spares,
                "chaos": cfg.chaos or "",
                "zygote_import_s": ready.get("import_s", 0.0),
                "hang_floor_s": cfg.hang.floor_s,
                "hang_k": cfg.hang.k,
            },
        )
        self.events.emit(
            "generation", generation=self.generation, world_size=cfg.world_size, reason="start"
        )
        for _ in range(cfg.spares):
            self._prefork()

    # ---------------------------------------------------------------- spawning
    def _spec(self, w: _Worker) -> dict[str, Any]:
        cfg = self.cfg
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            {
                "RANK": str(w.rank),
                "LOCAL_RANK": str(w.local),
                "WORLD_SIZE": str(cfg.world_size),
                "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
                "GROUP_RANK": str(cfg.node_rank),
                "GROUP_WORLD_SIZE": str(cfg.nnodes),
                "ROLE_RANK": str(w.rank),
                "ROLE_WORLD_SIZE": str(cfg.world_size),
                "ROLE_NAME": "default",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(self.restarts),
                "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
                "TORCHELASTIC_RUN_ID": cfg.job,
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "STALWART_RUN_DIR": self.run_dir,
                "STALWART_JOB": cfg.job,
                "STALWART_STORE": self.store_addr,
                "STALWART_TOKEN_FILE": self.token_file,
                "STALWART_C10D": self.c10d_addr,
                "STALWART_STRATEGY": cfg.strategy,
                "STALWART_NODE_RANK": str(cfg.node_rank),
                "STALWART_PROGRESS": self._board.path if self._board else "",
                "STALWART_PROGRESS_SLOT": str(w.local),
                "STALWART_CHAOS_PLAN": self.plan_path,
                "STALWART_HANG_CEILING": str(cfg.hang.ceiling_s),
                **cfg.runtime.env(),
            }
        )
        log = None
        if cfg.redirect:
            os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
            log = os.path.join(self.run_dir, "logs", f"rank{w.rank}.log")
        return {"env": env, "argv": [cfg.script, *cfg.script_args], "cwd": os.getcwd(), "log": log}

    def _spawn(self, w: _Worker) -> None:
        assert self._zygote is not None and self._board is not None
        self._board.clear(w.local)
        w.state, w.cause, w.pid, w.t_spawn = "starting", "", 0, time.time()
        if self.cfg.strategy == "spare" and self.spares and self.generation > 0:
            spare = self.spares.pop(0)
            self._zygote.send({"op": "assign", "pid": spare, "spec": self._spec(w)})
            w.pid, w.state = spare, "running"
            self._prefork()
        else:
            self._pending_spawn[f"rank-{w.rank}"] = w.rank
            self._zygote.send({"op": "spawn", "id": f"rank-{w.rank}", "spec": self._spec(w)})
        self.events.emit(
            "member_join",
            member=f"rank{w.rank}",
            node=self.cfg.node_rank,
            rank=w.rank,
            generation=self.generation,
        )

    def _prefork(self) -> None:
        assert self._zygote is not None
        self._zygote.send({"op": "prefork", "id": "spare-pending"})

    # ---------------------------------------------------------------- events
    def _on_message(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "spawned":
            ident = str(msg["id"])
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

    def _by_pid(self, pid: int) -> _Worker | None:
        return next((w for w in self.workers.values() if w.pid == pid), None)

    def _on_exit(self, pid: int, rc: int, t_exit: float) -> None:
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
        if w.cause != "hang":
            fired = self.ledger.fired_at(pid=pid)
            latency = now - (fired if fired is not None else t_exit)
            how = f"process exit (rc {rc})"
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
        self._recover(w, cause=w.cause or "crash")

    # ---------------------------------------------------------------- recovery
    def _attached(self) -> bool:
        return all(w.attached for w in self.workers.values())

    def _bump(self, reason: str) -> None:
        change = self.coord.advance_generation(self.generation, reason)
        self.generation = change.generation
        self.events.emit(
            "generation", generation=self.generation, world_size=self.cfg.world_size, reason=reason
        )

    def _recover(self, failed: _Worker, cause: str) -> None:
        cfg = self.cfg
        self._t_recovery = time.time()
        member = f"rank{failed.rank}"
        if self.coord.record_failure(member, cause):
            self.events.emit("isolation", member=member, reason=cause, blocklisted=True)
            _say(f"rank {failed.rank} failed too often; blocklisted")
            self.coord.unblock(member)  # a rank is a slot, not a machine: start it afresh
        # plain scripts (no stalwart runtime) cannot re-form in place: torchrun's route
        strategy = cfg.strategy if self._attached() else "restart"
        if strategy == "restart":
            if self.restarts >= cfg.max_restarts:
                _say(f"rank {failed.rank} failed and --max-restarts={cfg.max_restarts} is spent")
                raise _RunFailed(f"rank {failed.rank} failed ({cause}); no restarts left")
            self.restarts += 1
            self._stop_all("restart")
            self.master_port = _free_port()
            self._bump(f"restart after {cause} of rank {failed.rank}")
            self.events.emit(
                "recovery_begin", strategy="restart", generation=self.generation, cause=cause
            )
            _say(f"restarting all workers (restart {self.restarts}/{cfg.max_restarts})")
            for w in self.workers.values():
                self._spawn(w)
            return
        self._bump(f"{cause} of rank {failed.rank}")
        self.events.emit(
            "recovery_begin", strategy=strategy, generation=self.generation, cause=cause
        )
        self._spawn(failed)

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
    def _check_hang(self, now: float) -> None:
        assert self._board is not None
        slots = {
            w.rank: self._board.read(w.local)
            for w in self.workers.values()
            if w.state == "running" and w.pid and not w.cause
        }
        slots = {r: s for r, s in slots.items() if s.pid == self.workers[r].pid}
        for r, s in slots.items():
            self.workers[r].attached |= s.attached
        verdict = find_hang(slots, now, self.cfg.hang, since=self._t_recovery)
        if verdict is None:
            return
        for rank in verdict.ranks:
            w = self.workers[rank]
            fired = self.ledger.fired_at(pid=w.pid)
            latency = now - fired if fired is not None else verdict.stalled_s
            self.events.emit(
                "fault_detected",
                fault="hang",
                domain={"rank": rank, "node": self.cfg.node_rank},
                latency_s=latency,
                how=f"{verdict.how} for {verdict.stalled_s:.2f}s "
                f"(threshold {verdict.threshold_s:.2f}s)",
            )
            _say(f"rank {rank} hung ({verdict.how}); detected in {latency:.2f} s, killing it")
            w.cause = "hang"
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
        self._t_recovery = now

    def run(self) -> int:
        self._start()
        assert self._zygote is not None
        for w in self.workers.values():
            self._spawn(w)
        try:
            while True:
                for msg in self._zygote.events(self.cfg.monitor_interval_s):
                    self._on_message(msg)
                if all(w.state == "done" for w in self.workers.values()):
                    self.status = "ok"
                    return 0
                now = time.time()
                self._check_hang(now)
                self.chaos.tick(now - self._t0)
        except _RunFailed as err:
            self._end_reason = str(err)
            return 1
        except KeyboardInterrupt:
            self.status = "interrupted"
            return 130

    def last_step(self) -> int | None:
        if self._board is None:
            return None
        steps = [self._board.read(w.local).step for w in self.workers.values()]
        return max(steps) if steps else None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stop_all("shutdown", timeout=5.0)
        self.events.emit(
            "run_end",
            status=self.status,
            last_step=self.last_step(),
            reason=getattr(self, "_end_reason", ""),
        )
        if self._zygote is not None:
            self._zygote.close()
        if self._server is not None:
            self._server.stop()
        if self._board is not None:
            self._board.close(unlink=True)
        for w in self.workers.values():
            shutil.rmtree(f"/dev/shm/stalwart-{self.cfg.job}-r{w.rank}", ignore_errors=True)
        for path in glob.glob(f"/dev/shm/stalwart-{self.cfg.job}-spare*"):
            shutil.rmtree(path, ignore_errors=True)
        self.events.close()


class _RunFailed(StalwartError):
    pass


def run_agent(config: LaunchConfig) -> int:
    """Run one node's agent to the end of the job; returns the exit code."""
    agent = Agent(config)
    try:
        return agent.run()
    finally:
        agent.close()
