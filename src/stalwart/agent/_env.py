"""The environment of a worker: torchrun's variables plus stalwart's own."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stalwart.agent.config import LaunchConfig

if TYPE_CHECKING:
    from stalwart.agent.agent import Agent

__all__ = [
    "Worker",
    "WorkerSpec",
    "error_dir",
    "error_message",
    "spawn_spec",
    "worker_env",
]


@dataclass
class Worker:
    """One rank this agent runs: its process and what the agent knows of it."""

    rank: int
    local: int  # LOCAL_RANK
    slot: int  # progress-board index
    pid: int = 0
    state: str = "starting"  # starting | running | done | dead | gone (left for good)
    cause: str = ""  # why the agent killed it: hang | restart | chaos | shutdown
    attached: bool = False  # its script runs the stalwart runtime (sticky across restarts)
    t_spawn: float = 0.0
    incarnation: str = ""  # elastic: this process's life of the member slot


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local: int  # LOCAL_RANK (an adopted rank keeps its original one)
    slot: int  # index on this node's progress board


def worker_env(
    cfg: LaunchConfig,
    spec: WorkerSpec,
    *,
    restarts: int,
    master_port: int,
    extra: dict[str, str],
    master_addr: str = "",
) -> dict[str, str]:
    """torchrun's variables as torchrun sets them (``MASTER_ADDR``: node 0's host name,
    ``socket.getfqdn()`` there), then stalwart's; ``TORCHELASTIC_ERROR_FILE`` is set per
    process by the zygote (:func:`error_dir`)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    host = master_addr or cfg.endpoint()[0]
    env.update(
        {
            "RANK": str(spec.rank),
            "LOCAL_RANK": str(spec.local),
            "WORLD_SIZE": str(cfg.world_size),
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
            "GROUP_RANK": str(cfg.node_rank),
            "GROUP_WORLD_SIZE": str(cfg.nnodes),
            "ROLE_RANK": str(spec.rank),
            "ROLE_WORLD_SIZE": str(cfg.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": host,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restarts),
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            "TORCHELASTIC_RUN_ID": cfg.job,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "STALWART_JOB": cfg.job,
            "STALWART_STRATEGY": cfg.strategy,
            "STALWART_NODE_RANK": str(cfg.node_rank),
            "STALWART_PROGRESS_SLOT": str(spec.slot),
            "STALWART_HANG_CEILING": str(cfg.hang.ceiling_s),
            "STALWART_MIN_WORLD": str(cfg.min_world),
            "STALWART_ELASTIC_WAIT": str(cfg.elastic_wait_s),
            **cfg.runtime.env(),
            **extra,
        }
    )
    return env


def spawn_spec(agent: Agent, spec: WorkerSpec, extra: dict[str, str]) -> dict[str, Any]:
    """What the zygote needs to start a worker of ``agent``: its environment (torchrun's
    variables, the job's ``STALWART_*`` ones, then ``extra``), argv, cwd and log file."""
    cfg = agent.cfg
    env = worker_env(
        cfg,
        spec,
        restarts=agent.restarts,
        master_port=agent.master_port,
        master_addr=getattr(agent, "master_addr", ""),
        extra={
            "STALWART_RUN_DIR": agent.run_dir,
            "STALWART_STORE": agent.cluster.address,
            "STALWART_TOKEN_FILE": os.path.abspath(agent.cluster.token_file),
            "STALWART_C10D": agent.c10d_addr,
            "STALWART_PROGRESS": agent._board.path if agent._board else "",
            "STALWART_CHAOS_PLAN": agent.plan_path,
            **agent.cluster.worker_env(),
            **extra,
        },
    )
    log = None
    if cfg.redirect:
        os.makedirs(os.path.join(agent.run_dir, "logs"), exist_ok=True)
        log = os.path.join(agent.run_dir, "logs", f"rank{spec.rank}.log")
    return {
        "env": env,
        "argv": [cfg.script, *cfg.script_args],
        "cwd": os.getcwd(),
        "log": log,
        "error_dir": error_dir(agent.run_dir),
    }


def error_dir(run_dir: str) -> str:
    """Where workers' ``TORCHELASTIC_ERROR_FILE``s go (``rank<r>.<pid>.json``)."""
    path = os.path.join(run_dir, "errors")
    os.makedirs(path, exist_ok=True)
    return path


def error_message(run_dir: str, rank: int, pid: int) -> str | None:
    """The first line of the exception a failed worker's ``@record`` wrote (torchrun's
    error file format: ``{"message": {"message": "Type: text", "extraInfo": ...}}``), or
    None when it wrote none. The file is removed once read."""
    path = os.path.join(run_dir, "errors", f"rank{rank}.{pid}.json")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.read(1 << 20)
        os.unlink(path)
        data = json.loads(raw)
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    if not isinstance(msg, str) or not msg.strip():
        return None
    line = msg.strip().splitlines()[0]
    # one line for a terminal: no control characters from the worker's text
    return "".join(c if c.isprintable() else "?" for c in line)[:300]
