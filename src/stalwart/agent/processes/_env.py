"""The environment of a worker: its contract (contract/env.py), built from the launch.

The contract's format and defaults live in :mod:`stalwart.contract.env`; this module only
fills one in for each worker from the job's config and what the node agent learned.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from stalwart.agent.cluster._follow import watch_wait
from stalwart.agent.config import LaunchConfig
from stalwart.contract.env import WorkerEnv, WorkerFields, knob_values

__all__ = [
    "NodeFacts",
    "WorkerFields",
    "WorkerSpec",
    "error_dir",
    "error_message",
    "worker_contract",
    "worker_environ",
]


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local: int  # LOCAL_RANK (an adopted rank keeps its original one)
    slot: int  # index on this node's progress board


@dataclass(frozen=True)
class NodeFacts:
    """What a node agent learned at start-up that it tells every worker it starts."""

    run_dir: str
    store: str
    """The coordinator's address: ``host:port`` of the embedded store (unused under
    ``--rdzv etcd://``, where the workers reach etcd themselves)."""
    token_file: str
    c10d: str
    """``host:port`` of the TCPStore node 0's zygote hosts ("" under etcd)."""
    progress: str
    chaos_plan: str
    master_addr: str = ""
    """torchrun's ``MASTER_ADDR`` (node 0's host name); "": this node's endpoint host."""
    gen_relay: str = ""
    """Where the agent tells its workers the generation (agent/cluster/_relay.py)."""


def worker_contract(
    cfg: LaunchConfig,
    spec: WorkerSpec,
    node: NodeFacts,
    *,
    restarts: int,
    master_port: int,
    fields: WorkerFields,
) -> WorkerEnv:
    """The contract of one worker: torchrun's variables as torchrun sets them
    (``MASTER_ADDR``: node 0's host name, ``socket.getfqdn()`` there), then stalwart's;
    ``TORCHELASTIC_ERROR_FILE`` is set per process by the zygote (:func:`error_dir`)."""
    host, sep, port = node.store.rpartition(":")
    store = None if cfg.etcd or not (sep and port.isdigit()) else (host, int(port))
    # the launch's rank and size unless the policy sets them (a sharded elastic resize)
    fields = {"rank": spec.rank, "world_size": cfg.world_size, **fields}
    return WorkerEnv(
        local_rank=spec.local,
        local_world_size=cfg.nproc_per_node,
        node_rank=cfg.node_rank,
        nnodes=cfg.nnodes,
        master_addr=node.master_addr or cfg.endpoint()[0],
        master_port=master_port,
        restart_count=restarts,
        max_restarts=cfg.max_restarts,
        job=cfg.job,
        strategy=cfg.strategy,
        run_dir=node.run_dir,
        store=store,
        token_file=node.token_file,
        c10d_addr=node.c10d,
        progress=node.progress,
        progress_slot=spec.slot,
        chaos_plan=node.chaos_plan,
        hang_ceiling_s=cfg.hang.ceiling_s,
        watch_wait_s=watch_wait(cfg.node_lease_s),
        gen_relay=node.gen_relay,
        **knob_values(cfg.runtime),
        min_world=cfg.min_world,
        ckpt_tier=cfg.ckpt_tier or "",
        s3_endpoint=cfg.s3_endpoint or "",
        elastic_wait_s=cfg.elastic_wait_s,
        **fields,
    )


def worker_environ(contract: WorkerEnv) -> dict[str, str]:
    """A worker's whole environment: the agent's own, then the contract's variables."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(contract.to_environ())
    return env


def error_dir(run_dir: str) -> str:
    """Where workers' ``TORCHELASTIC_ERROR_FILE``s go (``rank<r>.<pid>.json``)."""
    path = os.path.join(run_dir, "errors")
    os.makedirs(path, mode=0o700, exist_ok=True)
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
