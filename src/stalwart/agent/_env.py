"""The environment of a worker: torchrun's variables plus stalwart's own."""

from __future__ import annotations

import os
from dataclasses import dataclass

from stalwart.agent.config import LaunchConfig

__all__ = ["WorkerSpec", "worker_env"]


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
) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    host = cfg.endpoint()[0]
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
