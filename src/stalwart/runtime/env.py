"""What the agent tells a worker, read once from its environment.

Only ``stalwart.init()`` reads these ``STALWART_*`` variables; they are set by the agent
for its own workers and describe the job, never override a user's argument.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["WorkerEnv"]


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    job: str
    run_dir: str
    store: tuple[str, int] | None  # the coordinator store (None: no agent)
    token_file: str
    c10d: tuple[str, int] | None  # TCPStore that outlives every worker
    strategy: str
    restart_count: int
    progress: str
    progress_slot: int
    chaos_plan: str
    persist_every: int
    snapshot_budget: float
    collective_timeout_s: float
    hang_ceiling_s: float
    agent_store: bool = False  # torchrun hosts the c10d store at MASTER_ADDR:MASTER_PORT
    rdzv: str = ""  # etcd://... : the coordinator (and the gloo rendezvous) live in etcd
    fence: str = ""  # "NODE:CREATE_REVISION" of the agent's member key (etcd only)
    snapshot_every: int = 0  # fixed snapshot cadence in steps (0: from the budget)
    min_world: int = 1  # elastic: fewest members the job trains with
    elastic_wait_s: float = 600.0  # elastic: how long to wait below min_world
    incarnation: str = ""  # elastic: this process's life of its member slot (set by the agent)
    step_p99_s: float = 0.0  # the rank's p99 step time so far in the job (a replacement's)
    standby: str = (
        ""  # a parked standby: the file whose appearance activates it (agent/_standby.py)
    )
    keep_last: int = 3  # retention: committed checkpoints kept per checkpoint directory
    keep_every: int = 0  # retention: milestone steps also kept (0: none)
    shm_run: str = ""  # the run id in the job's /dev/shm names (checkpoint/slots.py)

    @property
    def managed(self) -> bool:
        """Launched by `stalwart run` (else: plain python or torchrun)."""
        return self.store is not None or bool(self.rdzv)

    @staticmethod
    def _addr(text: str) -> tuple[str, int] | None:
        host, sep, port = text.rpartition(":")
        return (host, int(port)) if sep and port.isdigit() else None

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        e = os.environ if env is None else env
        run_dir = e.get("STALWART_RUN_DIR", "")
        job = e.get("STALWART_JOB", "") or e.get("TORCHELASTIC_RUN_ID", "") or "local"
        return cls(
            rank=int(e.get("RANK", "0")),
            world_size=int(e.get("WORLD_SIZE", "1")),
            local_rank=int(e.get("LOCAL_RANK", "0")),
            node_rank=int(e.get("STALWART_NODE_RANK", e.get("GROUP_RANK", "0"))),
            job=job,
            run_dir=run_dir,
            store=cls._addr(e.get("STALWART_STORE", "")),
            token_file=e.get("STALWART_TOKEN_FILE", ""),
            c10d=cls._addr(e.get("STALWART_C10D", ""))
            or cls._addr(f"{e.get('MASTER_ADDR', '')}:{e.get('MASTER_PORT', '')}"),
            strategy=e.get("STALWART_STRATEGY", "flash"),
            restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", "0")),
            progress=e.get("STALWART_PROGRESS", ""),
            progress_slot=int(e.get("STALWART_PROGRESS_SLOT", "0")),
            chaos_plan=e.get("STALWART_CHAOS_PLAN", ""),
            persist_every=int(e.get("STALWART_PERSIST_EVERY", "0")),
            snapshot_budget=float(e.get("STALWART_SNAPSHOT_BUDGET", "0.02")),
            collective_timeout_s=float(e.get("STALWART_COLLECTIVE_TIMEOUT", "1800")),
            hang_ceiling_s=float(e.get("STALWART_HANG_CEILING", "300")),
            agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True",
            rdzv=e.get("STALWART_RDZV", ""),
            fence=e.get("STALWART_FENCE", ""),
            snapshot_every=int(e.get("STALWART_SNAPSHOT_EVERY", "0")),
            min_world=int(e.get("STALWART_MIN_WORLD", "1")),
            elastic_wait_s=float(e.get("STALWART_ELASTIC_WAIT", "600")),
            incarnation=e.get("STALWART_INCARNATION", ""),
            standby=e.get("STALWART_STANDBY", ""),
            keep_last=max(1, int(e.get("STALWART_KEEP_LAST", "3"))),
            keep_every=max(0, int(e.get("STALWART_KEEP_EVERY", "0"))),
            step_p99_s=max(0.0, float(e.get("STALWART_STEP_P99", "0") or 0)),
            shm_run=e.get("STALWART_SHM_RUN", ""),
        )
