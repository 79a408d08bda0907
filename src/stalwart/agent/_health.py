"""The node's health: its probes' watch and the preflight check, as one part of the
agent. A failing probe or a preflight verdict against this node takes the node out of
the job before the fault takes the job down (agent/_probe_watch.py ``isolate_node``).

The probes read this node's /dev/shm growth (the slots of the ranks it hosts now), the
checkpoint disk and, where present, NVML; the preflight pairs this node with the others
through the cluster's store (agent/_preflight.py)."""

from __future__ import annotations

import os

from stalwart.agent._cluster import Cluster
from stalwart.agent._preflight import PreflightConfig, report, run_check, run_preflight
from stalwart.agent._probe_watch import ProbeWatch, build_probes, isolate_node
from stalwart.agent._types import NodeContext
from stalwart.agent._workers import LocalWorkers
from stalwart.agent.detection._finished import finished_rank
from stalwart.agent.detection.incidents import ProbeFailed
from stalwart.agent.probes import slot_growth

__all__ = ["NodeHealth"]


class NodeHealth:
    """Owns the node's :class:`ProbeWatch` thread; ``check()`` isolates the node on a
    probe failure, ``preflight()`` before the first generation."""

    def __init__(self, ctx: NodeContext, cluster: Cluster, workers: LocalWorkers):
        self.ctx, self.cluster, self._workers = ctx, cluster, workers
        cfg, names = ctx.cfg, cluster.names
        pending = lambda: slot_growth(names.rank_dir(r) for r in workers.ranks())  # noqa: E731
        ckpt = os.path.join(ctx.run_dir, "ckpt")
        probes = build_probes(cfg.probes, ckpt_dir=ckpt, shm_pending=pending)
        self.watch = ProbeWatch(
            probes,
            interval_s=cfg.probes.interval_s,
            node=cfg.node_rank,
            events=ctx.events,
            say=ctx.say,
        )
        self.watch.start()

    def close(self) -> None:
        self.watch.close()

    def check(self) -> None:
        """Isolate the node for a probe that started failing (``--on-probe``)."""
        for failed in self.watch.failures():
            self._isolate(failed)

    def _isolate(self, failed: ProbeFailed) -> None:
        what = f"GPU {failed.device} " if failed.device is not None else ""
        why = f"probe {failed.probe} failed: {what}{failed.detail}"
        ctx = self.ctx
        # a rank that finished the job (agent/detection/_finished.py): nothing is left to move
        done = finished_rank(self._workers, self.cluster, ctx.cfg.world_size)
        isolate_node(ctx.cfg, self.cluster, ctx.events, ctx.say, why, finished=done)

    def preflight(self) -> None:
        """Check this node against the others before the first generation: a slow or
        failing node leaves now (agent/_preflight.py), its ranks start elsewhere."""
        ctx = self.ctx
        cfg, pcfg = ctx.cfg, PreflightConfig()
        check = run_check(pcfg, cfg.node_rank)
        nodes = list(range(cfg.nnodes))
        verdicts, seconds = run_preflight(
            nodes, cfg.node_rank, self.cluster, check, host=cfg.node_address, cfg=pcfg
        )
        report(ctx.events, verdicts, seconds, node=cfg.node_rank, say=ctx.say)
        mine = verdicts[cfg.node_rank]
        if not mine.ok:
            why = f"preflight {mine.verdict}: {mine.detail}"
            isolate_node(cfg, self.cluster, ctx.events, ctx.say, why)
