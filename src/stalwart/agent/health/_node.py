"""The node's health as one part of the agent: its probes' watch and the preflight.

A failing probe or a preflight verdict against this node takes the node out of the job
before the fault takes the job down (:func:`isolate_node`). :class:`NodeHealth` owns the
part: the probes read this node's /dev/shm growth (the slots of the ranks it hosts now),
the checkpoint disk and, where present, NVML (agent/health/probes.py); the preflight
pairs this node with the others through the cluster's store (agent/health/preflight.py).

:class:`ProbeWatch` runs the probes on a thread. Why a thread: the write-speed probe
writes and fsyncs a few MiB and NVML calls can take milliseconds; the agent's loop polls
its workers every 20 ms and must not wait for either. The loop calls
:meth:`ProbeWatch.failures` each turn: the events are written there (on the loop's
thread), and a probe that starts failing comes back as a
:class:`~stalwart.agent.detection.incidents.ProbeFailed` for the agent to isolate the node
(the ``--on-probe`` policy).

What is written (docs/events.md, ``probe``): every probe's first reading (so a report
shows what was watched, and which probes were skipped, with why), then only changes: a
probe that fails (with ``fault_detected``, domain the node or the GPU), and one that
recovers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from stalwart.agent._outcome import Cordoned
from stalwart.agent._types import EventSink, NodeContext, Say
from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.config import LaunchConfig
from stalwart.agent.detection._finished import finished_rank
from stalwart.agent.detection.incidents import ProbeFailed
from stalwart.agent.health.preflight import PreflightConfig, report, run_check, run_preflight
from stalwart.agent.health.probes import Probe, ProbeResult, build_probes, slot_growth
from stalwart.agent.processes._workers import LocalWorkers
from stalwart.coordinator import Coordinator
from stalwart.logs import get_logger

__all__ = ["NodeHealth", "ProbeWatch", "isolate_node", "probe_event"]

_log = get_logger(__name__)


def probe_event(events: EventSink, r: ProbeResult, node: int) -> None:
    """One ``probe`` event for ``r`` (the fields docs/events.md lists)."""
    extra: dict[str, object] = {}
    if r.value is not None:
        extra["value"] = r.value
    if r.limit is not None:
        extra["limit"] = r.limit
    events.emit(
        "probe",
        probe=r.probe,
        ok=r.ok,
        skipped=r.skipped,
        detail=r.detail,
        unit=r.unit,
        domain={"rank": None, "node": node, "device": r.device},
        **extra,
    )


class ProbeWatch:
    """The node's probes, run every ``interval_s`` on a daemon thread."""

    def __init__(
        self,
        probes: Sequence[Probe],
        *,
        interval_s: float,
        node: int,
        events: EventSink,
        say: Say,
    ) -> None:
        self._probes, self._interval, self._node = list(probes), interval_s, node
        self._events, self._say = events, say
        self._lock = threading.Lock()
        self._fresh: list[ProbeResult] = []  # read by the thread, not yet reported
        self._state: dict[tuple[str, int | None], bool] = {}  # last reported ok
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._probes and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stalwart-probes", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self.round()
            if self._stop.wait(self._interval):
                return

    def round(self) -> None:
        """Run every probe once (the thread's work; tests call it directly)."""
        for probe in self._probes:
            try:
                results = probe.check()
            except Exception as err:  # a probe must not raise; if one does, say so
                detail = f"probe {probe.name} raised {type(err).__name__}: {err}"
                results = [ProbeResult(probe.name, True, detail, skipped=True)]
            with self._lock:
                self._fresh.extend(results)

    def failures(self) -> list[ProbeFailed]:
        """Write the events of what the thread read since the last call; the probes
        that started failing."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
        out = []
        for r in fresh:
            key = (r.probe, r.device)
            before = self._state.get(key)
            if before is not None and before == r.ok:
                continue
            self._state[key] = r.ok
            probe_event(self._events, r, self._node)
            if r.skipped:
                say = _log.debug if r.quiet else self._say
                say(f"probe {r.probe} skipped: {r.detail}")
            elif not r.ok:
                out.append(self._failed(r))
            elif before is False:
                self._say(f"probe {r.probe} healthy again: {r.detail}")
        return out

    def _failed(self, r: ProbeResult) -> ProbeFailed:
        domain = {"rank": None, "node": self._node, "device": r.device}
        self._events.emit(
            "fault_detected", fault=f"probe_{r.probe}", domain=domain, latency_s=0.0, how=r.detail
        )
        self._say(f"node {self._node} probe {r.probe} failed: {r.detail}")
        return ProbeFailed(self._node, r.probe, r.device, r.detail)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def isolate_node(
    cfg: LaunchConfig,
    coord: Coordinator,
    events: EventSink,
    say: Say,
    why: str,
    *,
    finished: int | None = None,
) -> None:
    """Take this node out of the job for ``why`` (a failing probe, a preflight verdict):
    blocklisted, it leaves like a lost node (:class:`Cordoned`, exit code 3) and the
    leader adopts its ranks, which recover by the job's strategy. A node that cannot
    leave (the only node; node 0 when it hosts the embedded store) says why it stays,
    and so does ``--on-probe report``, and a node once rank ``finished`` finished the
    job (agent/detection/_finished.py: its ranks trained to the end, there is nothing to move, and
    adopted elsewhere they would wait for peers that have exited)."""
    node = cfg.node_rank
    if finished is not None:
        stays = f"rank {finished} finished the job: nothing to move, the node ends with it"
    elif cfg.probes.on_failure == "report":
        stays = "--on-probe report: the node stays in the job"
    elif cfg.nnodes == 1:
        stays = "the only node: nowhere to move its ranks, it stays"
    elif node == 0 and not cfg.etcd:
        stays = "node 0 hosts the job's store and cannot leave (use --rdzv etcd://...)"
    else:
        stays = ""
    if stays:
        events.emit("note", message=f"node {node}: {why}; {stays}")
        say(f"node {node}: {why}; {stays}")
        return
    member = f"node{node}"
    coord.block(member, why)
    events.emit("isolation", member=member, reason=why, blocklisted=True)
    say(f"node {node} isolated ({why}): blocklisted, its ranks move to a healthy node")
    raise Cordoned(f"node {node} isolated: {why}")


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
        isolate_node(ctx.cfg, self.cluster.coord, ctx.events, ctx.say, why, finished=done)

    def preflight(self) -> None:
        """Check this node against the others before the first generation: a slow or
        failing node leaves now (agent/health/preflight.py), its ranks start elsewhere."""
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
            isolate_node(cfg, self.cluster.coord, ctx.events, ctx.say, why)
