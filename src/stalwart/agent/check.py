"""`stalwart check`: the preflight node check and one round of the health probes,
without a training job.

Every node of the would-be job runs ``stalwart check`` with the flags it would give
``stalwart run`` (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` or ``--rdzv``): the
nodes join a coordinator exactly as a job's agents do, run the paired check
(agent/_preflight.py) and their probes (agent/probes.py) once, print the verdicts and
leave. Nothing is blocklisted (no job to keep a node out of); the exit code says
whether this node is fit (0) or not (1), so a scheduler can drain it before the job
starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stalwart.agent._cluster import Cluster
from stalwart.agent._preflight import NodeVerdict, PreflightConfig, report, run_check, run_preflight
from stalwart.agent._private import make_private_dir
from stalwart.agent._probe_watch import build_probes
from stalwart.agent.config import LaunchConfig
from stalwart.agent.probes import ProbeResult
from stalwart.logs import get_logger
from stalwart.metrics.events import EVENTS_FILE, EventLog

__all__ = ["CheckResult", "PreflightConfig", "check_node"]

_log = get_logger(__name__)


@dataclass(frozen=True)
class CheckResult:
    verdicts: dict[int, NodeVerdict]  # every node's, alike on every node
    probes: list[ProbeResult]  # this node's
    seconds: float  # the paired check's wall time (preflight_s)

    def fit(self, node: int) -> bool:
        return self.verdicts[node].ok and all(p.ok for p in self.probes)


def check_node(cfg: LaunchConfig, preflight: PreflightConfig | None = None) -> CheckResult:
    """Run this node's part of the check (``cfg``: the job's node flags; its
    ``script`` is never run)."""
    pcfg = preflight or PreflightConfig()
    run_dir = os.path.abspath(cfg.run_dir or os.path.join("runs", cfg.job))
    make_private_dir(run_dir)  # 0700, this user's (docs/security.md)
    cluster = Cluster(cfg, run_dir)
    with EventLog(os.path.join(run_dir, EVENTS_FILE), node=cfg.node_rank) as events:
        cluster.start()
        try:
            check = run_check(pcfg, cfg.node_rank)
            nodes = list(range(cfg.nnodes))
            verdicts, seconds = run_preflight(
                nodes, cfg.node_rank, cluster, check, host=cfg.node_address, cfg=pcfg
            )
            report(events, verdicts, seconds, node=cfg.node_rank, say=_log.info)
            ckpt = os.path.join(run_dir, "ckpt")
            probes = [
                r
                for p in build_probes(cfg.probes, ckpt_dir=ckpt, shm_pending=lambda: 0)
                for r in p.check()
            ]
        finally:
            cluster.close()
    return CheckResult(verdicts, probes, seconds)
