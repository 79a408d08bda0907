"""The two ends of an agent's life: what it sets up before the first worker starts, and
what it leaves behind (nothing) at the end.

Teardown order matters, and the agent's ``ExitStack`` (agent/agent.py) keeps it by
registering each part's end as the part is set up: workers are stopped before
``run_end`` is written (so the record follows every worker event), the goodbye
(``agents-done``) is written before the watched connection and the store go away (so no
peer mistakes a clean end for a node loss), and shared memory is removed last, once
nothing maps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.agent._types import EventSink, NodeContext, Say
from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.cluster._generation import JobGeneration, free_port
from stalwart.agent.config import LaunchConfig
from stalwart.agent.detection.verdict import error_line_path
from stalwart.agent.processes._env import (
    NodeFacts,
    WorkerSpec,
    error_dir,
    worker_contract,
    worker_environ,
)
from stalwart.agent.processes._workers import Worker
from stalwart.agent.processes._zygote_client import ZygoteClient
from stalwart.agent.rundir._private import write_private
from stalwart.agent.rundir._tier import start_tier
from stalwart.chaos import FaultPlan
from stalwart.checkpoint.slots import run_owner, sweep_stale
from stalwart.contract.board import ProgressBoard
from stalwart.contract.env import WorkerFields
from stalwart.contract.shm_names import SlotNames
from stalwart.logs import get_logger

__all__ = [
    "C10d",
    "Launched",
    "WorkerSpecs",
    "clean_shm",
    "emit_run_start",
    "exchange_c10d",
    "launch",
    "preload_note",
    "start_live",
    "sweep_shm",
    "write_agent_json",
]

_log = get_logger(__name__)


class _Zygote(Protocol):
    def send(self, msg: dict[str, Any]) -> None: ...
    def wait_for(self, op: str, timeout: float) -> dict[str, Any]: ...


def preload_note(cfg: LaunchConfig, ready: dict[str, Any], say: Say) -> None:
    """Say once (node 0) what of the script's imports the zygote could not preload: the
    workers import those themselves, and each replacement pays for them again."""
    pre = ready.get("preload") or {}
    for line in pre.get("local_skipped", []):  # the script's own modules: one debug line
        _log.debug("not preloading the script's module %s", line)
    failed = [str(x) for x in pre.get("failed", [])]
    note = str(pre.get("note", ""))
    if cfg.node_rank != 0 or not (failed or note):
        return
    what = note or f"could not preload {'; '.join(failed)}"
    say(f"{what}; replacement workers import them again (slower recovery)")


def emit_run_start(
    events: EventSink,
    cfg: LaunchConfig,
    ready: dict[str, Any],
    generation: int,
    launch_t: float,
) -> None:
    """``launch_t``: when this agent was launched; the report's wall time starts there,
    the zygote's imports and the rendezvous before this event included (docs/goodput.md)."""
    events.emit(
        "run_start",
        launch_t=launch_t,
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
            "preloaded": list((ready.get("preload") or {}).get("imported", [])),
            "hang_floor_s": cfg.hang.floor_s,
            "hang_k": cfg.hang.k,
        },
    )
    events.emit("generation", generation=generation, world_size=cfg.world_size, reason="start")


@dataclass(frozen=True)
class C10d:
    """Where the workers' torch.distributed store is, and torchrun's MASTER_* values."""

    addr: str
    master_port: int
    master_addr: str


def exchange_c10d(cfg: LaunchConfig, cluster: Cluster, zygote: _Zygote, port: int) -> C10d:
    """Node 0 (any node under etcd, first come) publishes the launch's c10d record; every
    node reads the one that won."""
    host = cfg.endpoint()[0]
    fqdn = socket.getfqdn()  # torchrun's MASTER_ADDR: node 0's host name
    if cfg.etcd:  # gloo groups form over etcd too (runtime/_c10d_store.py)
        cluster.publish_once("c10d", {"addr": "", "master_port": port, "master_addr": fqdn})
    elif cfg.node_rank == 0:
        zygote.send({"op": "store", "host": host})
        store_port = zygote.wait_for("store", 30)["port"]
        cluster.publish(
            "c10d", {"addr": f"{host}:{store_port}", "master_port": port, "master_addr": fqdn}
        )
    launch = cluster.read("c10d", cfg.start_timeout_s)
    return C10d(
        str(launch["addr"]), int(launch["master_port"]), str(launch.get("master_addr") or host)
    )


@dataclass(frozen=True)
class Launched:
    """What the node runs its workers with, once the job's launch record is agreed."""

    board: ProgressBoard
    zygote: ZygoteClient
    c10d: C10d
    ready: dict[str, Any]  # the zygote's start report (import time, preloaded modules)
    files: tuple[str, str]  # the board's path, the chaos plan's
    generation: JobGeneration  # this node's view of the job's generation, read at join


def launch(
    ctx: NodeContext,
    plan: FaultPlan,
    cluster: Cluster,
    stack: contextlib.ExitStack,
    *,
    goodbye: Callable[[], bool],
) -> Launched:
    """Join the cluster (the node's :class:`JobGeneration` reads the job's generation
    through its coordinator right after), create the progress board (its name holds the
    run id agreed then), write the chaos plan, start the zygote and agree on the c10d
    record; each part's end goes on ``stack`` (``goodbye``: whether this node says one
    when it leaves)."""
    cfg, run_dir = ctx.cfg, ctx.run_dir
    # the bucket tier (--ckpt-tier): ckpt/ filled from the bucket before anything starts;
    # its uploader ends last, after the workers, with their last step uploaded
    if (end_tier := start_tier(cfg, run_dir, ctx.events, ctx.say)) is not None:
        stack.callback(end_tier)
    cluster.start()  # (it agrees the run id of the /dev/shm names)
    stack.callback(lambda: cluster.close(goodbye=goodbye()))
    sweep_shm(cluster.names, ctx)
    stack.callback(run_owner(cluster.names).remove)
    generation = JobGeneration(cluster.coord, cluster, ctx.events, cfg.world_size)
    generation.sync()
    board_path = cluster.names.progress_board(cfg.node_rank)
    # room for every rank (a node may adopt the ranks of a lost node), and for a parked
    # standby of each (its own ranks' under --strategy spare, agent/processes/_standby.py)
    board = ProgressBoard(board_path, 2 * cfg.world_size, create=True)
    stack.callback(board.close, unlink=True)
    os.makedirs(os.path.join(run_dir, "chaos"), mode=0o700, exist_ok=True)
    plan_path = os.path.join(run_dir, "chaos", "plan.json")
    if cfg.node_rank == 0:
        write_private(plan_path, plan.to_json())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    zygote = ZygoteClient(["stalwart.runtime.session"], env, script=cfg.script)
    stack.callback(zygote.close)
    ready = zygote.wait_ready(cfg.zygote.cpu_s, cfg.zygote.stall_s)
    preload_note(cfg, ready, ctx.say)
    c10d = exchange_c10d(cfg, cluster, zygote, free_port())
    return Launched(board, zygote, c10d, ready, (board_path, plan_path), generation)


def emit_run_end(
    ctx: NodeContext,
    cluster: Cluster,
    last_step: Callable[[], int | None],
    status: str,
    reason: str,
) -> None:
    """``run_end``, written by the one node that reports the job's end (node 0; under
    etcd the lowest live node), and its summary where that is not node 0: node 0 prints
    it when its agent closes (:func:`start_live`), and a job whose node 0 was lost ended
    rc 0 with no summary at all."""
    if not cluster.reports_end():
        return
    ctx.events.emit("run_end", status=status, last_step=last_step(), reason=reason)
    if ctx.cfg.node_rank != 0:
        from stalwart.metrics.ending import print_end

        print_end(ctx.run_dir)


def start_live(cfg: LaunchConfig, run_dir: str, say: Say) -> Callable[[], None]:
    """Node 0's console progress line and Prometheus endpoint (``--progress``,
    ``--metrics-port``); what ends them and then prints the end-of-run summary
    (metrics/ending.py), once the run's last event is written."""
    from stalwart.metrics.ending import print_end

    if cfg.metrics_port is None and not cfg.progress:
        return lambda: print_end(run_dir)
    from stalwart.metrics.follow import start_live as follow

    labels = {"job": cfg.job}
    live = follow(
        run_dir,
        metrics_port=cfg.metrics_port,
        metrics_host=cfg.metrics_host,
        console=cfg.progress,
        labels=labels,
    )
    for sink in live.sinks:
        if hasattr(sink, "url"):
            say(f"metrics at {sink.url}")

    def end() -> None:
        live.close()
        print_end(run_dir)

    return end


class WorkerSpecs:
    """What the zygote needs to start a worker (environment, argv, cwd, log file); a
    replacement inherits its rank's step-time history and reports its error."""

    def __init__(
        self,
        ctx: NodeContext,
        cluster: Cluster,
        up: Launched,
        generation: JobGeneration,
        history: dict[int, float],
        policy_env: Callable[[Worker], WorkerFields],
    ) -> None:
        """``history``: each rank's p99 step time; ``policy_env``: the strategy's own."""
        run_dir, c10d = ctx.run_dir, up.c10d
        self._cfg, self._run_dir, self._c10d, self._gen = ctx.cfg, run_dir, c10d, generation
        self._history, self._policy_env = history, policy_env
        board, plan = up.files
        self._node = NodeFacts(
            run_dir=run_dir,
            store=cluster.address,
            token_file=os.path.abspath(cluster.token_file),
            c10d=c10d.addr,
            progress=board,
            chaos_plan=plan,
            master_addr=c10d.master_addr,
            gen_relay=generation.relay_address,
        )
        self._cluster_fields = cluster.worker_env()

    def __call__(self, w: Worker, extra: WorkerFields) -> dict[str, Any]:
        own: WorkerFields = {
            **self._policy_env(w),
            "step_p99_s": round(self._history.get(w.rank, 0.0), 6),
            "error_line": error_line_path(self._run_dir, w.rank),
            **extra,
        }
        contract = worker_contract(
            self._cfg,
            WorkerSpec(w.rank, w.local, w.slot),
            self._node,
            restarts=self._gen.restarts,
            master_port=self._gen.master_port,
            fields={**self._cluster_fields, **own},
        )
        log = None
        if self._cfg.redirect:
            os.makedirs(os.path.join(self._run_dir, "logs"), mode=0o700, exist_ok=True)
            log = os.path.join(self._run_dir, "logs", f"rank{w.rank}.log")
        return {
            "env": worker_environ(contract),
            "argv": [self._cfg.script, *self._cfg.script_args],
            "cwd": os.getcwd(),
            "log": log,
            "error_dir": error_dir(self._run_dir),
        }


def sweep_shm(names: SlotNames, ctx: NodeContext) -> None:
    """Claim this run's /dev/shm names (the owner record), then remove what this user's
    dead runs left on this host (a SIGKILLed agent runs no teardown): only runs whose
    every owner is gone, never another user's (checkpoint/_stale.py)."""
    run_owner(names).write()
    removed = sweep_stale(names.shm_dir)
    if removed:
        why = f"removed {len(removed)} /dev/shm entries of dead runs of this user's"
        ctx.say(f"{why} (their agents ended without cleaning up)")
        ctx.events.emit("note", message=why)


def write_agent_json(run_dir: str, job: str, store: str) -> None:
    fd = os.open(os.path.join(run_dir, "agent.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"job": job, "store": store, "pid": os.getpid()}, f)


def clean_shm(cluster: Cluster, ranks: list[int]) -> None:
    """Remove the snapshot slots of ``ranks``; the last agent out (``cluster.last_out``)
    also removes what lost nodes left behind on this host (only this run's names:
    another job is not touched). An agent that ended before the run id was agreed made
    none. Only a member's ranks are its own: an agent the job refused at its start (its
    node lost and blocklisted, then started again) removes none of theirs, since on one
    host the node that adopted them uses the same slot names (bench/soak.py found it
    deleting them). Nor are a fenced agent's while another agent of the run lives on
    this host: its ranks were adopted, maybe by that agent, under the same names."""
    if not cluster.started:
        return
    names, everything = cluster.names, cluster.last_out
    if not cluster.joined:
        ranks = []
    elif cluster.lease.lost_reason is not None and run_owner(names).others_alive():
        ranks = []  # fenced: the node that adopted them may be on this host, using them
    for rank in ranks:
        shutil.rmtree(names.rank_dir(rank), ignore_errors=True)
    with contextlib.suppress(OSError):  # the fence handed to its workers after a rejoin
        os.unlink(names.fence_file(cluster.node))
    for path in names.everything() if everything else []:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
