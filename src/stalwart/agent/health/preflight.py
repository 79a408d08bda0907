"""The preflight node check (``stalwart run --preflight``, and ``stalwart check``).

Before the first generation every node runs a small matmul and an allreduce with a
partner (agent/health/_preflight_round.py, a process of its own). DLRover's method tells a
slow node from a slow link: in round 1 the nodes are paired (0-1, 2-3, ...); a node
whose matmul is far slower than the fastest node's is slow by itself; a pair whose
allreduce is far slower than the fastest pair's has a slow member *or* a slow link
between them, so in round 2 each member of a slow pair (and a node left without a
partner) is paired again with a node of a fast pair. Slow again: that node is slow
(its NIC, its PCIe, its CPU); fast with a fast partner: its round-1 partner was the
problem, and when both members of a slow pair are fast in round 2, the link between
them is slow (reported; both nodes stay). "Far slower" is ``factor`` times the
fastest (3x by default): this check is for broken hardware, not for noise.

Every node computes the same verdict from the results all nodes published (the
cluster's launch record); node 0 writes one ``preflight`` event per node with the
figures, and a slow or failing node isolates itself (agent/health/_node.py
:func:`isolate_node`): blocklisted, it leaves and its ranks move to a healthy node.

``stalwart check`` (:func:`check_node`) is the same check and one round of the probes
(agent/health/probes.py) without a training job: every node of the would-be job runs it
with the flags it would give ``stalwart run`` (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint`` or ``--rdzv``), joins a coordinator exactly as a job's agents do,
prints the verdicts and leaves. Nothing is blocklisted (no job to keep a node out of);
the exit code says whether this node is fit (0) or not (1), so a scheduler can drain it
before the job starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stalwart.agent._types import EventSink, Say
from stalwart.agent.cluster._cluster import Cluster
from stalwart.agent.config import LaunchConfig
from stalwart.agent.health.probes import ProbeResult, build_probes
from stalwart.agent.rundir._private import make_private_dir
from stalwart.errors import ConfigError
from stalwart.logs import get_logger
from stalwart.metrics.events import EVENTS_FILE, EventLog

__all__ = [
    "CheckResult",
    "Launch",
    "NodeVerdict",
    "PreflightConfig",
    "Timing",
    "check_node",
    "classify",
    "decide",
    "pair_up",
    "report",
    "retest_rounds",
    "run_check",
    "run_preflight",
]


@dataclass(frozen=True)
class PreflightConfig:
    """How the check measures and what counts as slow."""

    factor: float = 3.0
    """A node (or pair) slower than this many times the fastest is slow: the machines
    of one job are alike, so only a broken one is 3x off, while noise on a shared host
    is seldom 2x."""
    n: int = 512
    """Matmul size (N x N float32): about 270 MFLOP, a few ms on one core."""
    reps: int = 10
    """Repetitions of each measurement (the fastest is kept)."""
    mb: float = 4.0
    """Allreduce size in MiB: large enough to measure bandwidth, not only latency."""
    timeout_s: float = 120.0
    """How long one node waits for its partner (a node that never comes has failed)."""

    def __post_init__(self) -> None:
        if not (self.factor > 1 and self.n > 0 and self.reps > 0 and self.mb > 0):
            raise ConfigError("preflight: factor > 1, n, reps and mb > 0")


@dataclass(frozen=True)
class Timing:
    """One node's result in one round."""

    node: int
    partner: int
    matmul_s: float
    allreduce_s: float
    error: str = ""  # the check failed (the partner never came, torch failed, ...)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "partner": self.partner,
            "matmul_s": self.matmul_s,
            "allreduce_s": self.allreduce_s,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Timing:
        """A published result, every field checked (another node wrote it)."""
        try:
            node, partner = int(doc["node"]), int(doc["partner"])
            mm, ar, err = float(doc["matmul_s"]), float(doc["allreduce_s"]), str(doc["error"])
        except (KeyError, TypeError, ValueError) as e:
            return cls(-1, -1, math.inf, math.inf, f"malformed preflight record: {e}")
        if not (math.isfinite(mm) and math.isfinite(ar)) or mm < 0 or ar < 0:
            err = err or f"implausible figures matmul_s={mm} allreduce_s={ar}"
        return cls(node, partner, mm, ar, err[:500])


@dataclass(frozen=True)
class NodeVerdict:
    node: int
    ok: bool
    verdict: str  # ok | slow compute | slow node | failed | slow link (ok, reported)
    detail: str
    r1: Timing | None
    retest: Timing | None = None


def pair_up(nodes: list[int]) -> list[tuple[int, int]]:
    """Round 1: adjacent nodes; an odd last node waits for round 2."""
    return [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]


def _pair_time(r1: dict[int, Timing], a: int, b: int) -> float:
    return max(r1[a].allreduce_s, r1[b].allreduce_s)


def classify(
    nodes: list[int], r1: dict[int, Timing], factor: float
) -> tuple[dict[int, NodeVerdict], list[int], list[int]]:
    """Round 1's verdicts: the nodes already unfit (failed, slow compute), the suspects
    to pair again (members of slow pairs, a node without a partner), the fast nodes."""
    unfit: dict[int, NodeVerdict] = {}
    for n in nodes:
        if (t := r1.get(n)) is not None and t.error:
            unfit[n] = NodeVerdict(n, False, "failed", t.error, t)
    alive = [n for n in nodes if n in r1 and n not in unfit]
    if alive:
        best = min(r1[n].matmul_s for n in alive)
        for n in alive:
            mm = r1[n].matmul_s
            if mm > factor * best:
                why = f"matmul {mm * 1e3:.1f} ms, {mm / max(best, 1e-12):.1f}x the fastest node's"
                unfit[n] = NodeVerdict(n, False, "slow compute", why, r1[n])
    pairs = [(a, b) for a, b in pair_up(nodes) if a not in unfit and b not in unfit]
    base = min((_pair_time(r1, a, b) for a, b in pairs), default=math.inf)
    fast: list[int] = []
    suspects: list[int] = []
    for a, b in pairs:
        (suspects if _pair_time(r1, a, b) > factor * base else fast).extend((a, b))
    paired = {n for p in pair_up(nodes) for n in p}
    suspects += [n for n in nodes if n not in paired and n not in unfit]
    for a, b in pair_up(nodes):  # the partner of an unfit node has nothing to compare
        for n, other in ((a, b), (b, a)):
            if other in unfit and n not in unfit:
                suspects.append(n)
    return unfit, sorted(set(suspects)), fast


def retest_rounds(suspects: list[int], fast: list[int]) -> list[list[tuple[int, int]]]:
    """Round 2: each suspect with a fast node (fast node first: it hosts the store); a
    fast node checks with one suspect at a time, so more suspects than fast nodes make
    more sub-rounds."""
    if not fast:
        return []
    return [
        list(zip(fast, suspects[i : i + len(fast)], strict=False))
        for i in range(0, len(suspects), len(fast))
    ]


def decide(
    nodes: list[int],
    r1: dict[int, Timing],
    r2: dict[int, Timing],
    factor: float,
) -> dict[int, NodeVerdict]:
    """Every node's verdict from both rounds."""
    unfit, suspects, fast = classify(nodes, r1, factor)
    base = min((_pair_time(r1, a, b) for a, b in pair_up(nodes) if a in fast), default=math.inf)
    out = dict(unfit)
    for n in nodes:
        if n in out:
            continue
        t1, t2 = r1.get(n), r2.get(n)
        if n not in suspects:
            ar = f"allreduce {t1.allreduce_s * 1e3:.1f} ms with node {t1.partner}" if t1 else ""
            out[n] = NodeVerdict(n, True, "ok", ar, t1)
        elif t2 is None:
            out[n] = NodeVerdict(n, True, "ok", "no fast node to compare with", t1)
        elif t2.error:
            out[n] = NodeVerdict(n, False, "failed", f"retest: {t2.error}", t1, t2)
        elif t2.allreduce_s > factor * base:
            was = f"{t1.allreduce_s * 1e3:.1f} ms with node {t1.partner}, " if t1 else ""
            why = (
                f"allreduce {was}{t2.allreduce_s * 1e3:.1f} ms with fast node {t2.partner} "
                f"(fastest pair {base * 1e3:.1f} ms): slow with every partner"
            )
            out[n] = NodeVerdict(n, False, "slow node", why, t1, t2)
        else:
            why = f"fast with node {t2.partner} ({t2.allreduce_s * 1e3:.1f} ms)"
            out[n] = NodeVerdict(n, True, "ok", why, t1, t2)
    for a, b in pair_up(nodes):  # both fast again: the link between them is slow
        va, vb = out[a], out[b]
        if va.ok and vb.ok and va.retest is not None and vb.retest is not None:
            link = f"slow link between nodes {a} and {b}: each is fast with another node"
            out[a] = NodeVerdict(a, True, "slow link", link, va.r1, va.retest)
            out[b] = NodeVerdict(b, True, "slow link", link, vb.r1, vb.retest)
    return out


class Launch(Protocol):
    """What of the cluster (agent/cluster/_cluster.py) the preflight exchanges results through."""

    def publish(self, key: str, record: dict[str, Any]) -> None: ...
    def read(self, key: str, timeout: float) -> dict[str, Any]: ...


Check = Callable[[str, int, int], Timing]
"""``check(addr, rank_in_pair, partner)``: one node's measurement in one pair."""


def run_check(cfg: PreflightConfig, node: int) -> Check:
    """The real check: agent/health/_preflight_round.py as a process of its own."""

    def check(addr: str, rank: int, partner: int) -> Timing:
        cmd = [sys.executable, "-m", "stalwart.agent.health._preflight_round", addr, str(rank)]
        cmd += ["--n", str(cfg.n), "--reps", str(cfg.reps), "--mb", str(cfg.mb)]
        cmd += ["--timeout", str(cfg.timeout_s)]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=cfg.timeout_s + 60, check=False
            )
            doc = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as err:
            return Timing(node, partner, math.inf, math.inf, f"check process: {err}"[:500])
        if "error" in doc:
            return Timing(node, partner, math.inf, math.inf, str(doc["error"])[:500])
        return Timing.from_json({**doc, "node": node, "partner": partner, "error": ""})

    return check


def _round(
    name: str,
    pairs: list[tuple[int, int]],
    node: int,
    launch: Launch,
    check: Check,
    host: str,
    timeout: float,
) -> dict[int, Timing]:
    from stalwart.agent.cluster._generation import free_port

    for leader, other in pairs:
        if node in (leader, other):
            key = f"preflight-{name}-pair{leader}"
            if node == leader:
                launch.publish(key, {"addr": f"{host}:{free_port()}"})
            addr = str(launch.read(key, timeout)["addr"])
            rank, partner = (0, other) if node == leader else (1, leader)
            t = check(addr, rank, partner)
            launch.publish(f"preflight-{name}-node{node}", t.to_json())
    out = {}
    for n in (n for p in pairs for n in p):
        t = Timing.from_json(launch.read(f"preflight-{name}-node{n}", timeout * 2 + 60))
        out[n] = t if t.node == n else Timing(n, -1, math.inf, math.inf, t.error or "bad record")
    return out


def _alone(node: int, check: Check, host: str) -> dict[int, NodeVerdict]:
    """A single node has no partner: its check pairs with itself (two processes), which
    still tells a node whose torch, compute or gloo is broken; there is nobody to be
    slower than."""
    import threading

    from stalwart.agent.cluster._generation import free_port

    addr = f"{host}:{free_port()}"
    got: dict[int, Timing] = {}
    other = threading.Thread(target=lambda: got.__setitem__(1, check(addr, 1, node)))
    other.start()
    t = check(addr, 0, node)
    other.join()
    peer = got.get(1)
    errors = [x.error for x in (t, peer) if x is not None and x.error]
    if errors or peer is None:
        why = errors[0] if errors else "the second local check process gave no result"
        return {node: NodeVerdict(node, False, "failed", why, t)}
    detail = (
        f"single node: matmul {t.matmul_s * 1e3:.1f} ms, allreduce "
        f"{t.allreduce_s * 1e3:.1f} ms between two local processes (nobody to compare with)"
    )
    return {node: NodeVerdict(node, True, "ok", detail, t)}


def run_preflight(
    nodes: list[int],
    node: int,
    launch: Launch,
    check: Check,
    *,
    host: str,
    cfg: PreflightConfig,
) -> tuple[dict[int, NodeVerdict], float]:
    """This node's part of both rounds; every node's verdict and the seconds it took."""
    t0 = time.monotonic()
    if len(nodes) == 1:
        return _alone(node, check, host), time.monotonic() - t0
    r1 = _round("r1", pair_up(nodes), node, launch, check, host, cfg.timeout_s)
    _, suspects, fast = classify(nodes, r1, cfg.factor)
    r2: dict[int, Timing] = {}
    for j, pairs in enumerate(retest_rounds(suspects, fast)):
        r2.update(_round(f"r2.{j}", pairs, node, launch, check, host, cfg.timeout_s))
    return decide(nodes, r1, r2, cfg.factor), time.monotonic() - t0


def _ms(x: float) -> float:
    return x if math.isfinite(x) else -1.0  # a failed check has no figure (JSON has no inf)


def report(
    events: EventSink,
    verdicts: dict[int, NodeVerdict],
    seconds: float,
    *,
    node: int,
    say: Say,
) -> None:
    """Node 0 writes one ``preflight`` event per node (and ``fault_detected`` for an
    unfit one); every node says its own verdict."""
    mine = verdicts[node]
    say(f"preflight: node {node} {mine.verdict} ({mine.detail}) in {seconds:.1f} s")
    if node != 0:
        return
    for n, v in sorted(verdicts.items()):
        extra: dict[str, Any] = {}
        if v.r1 is not None:
            extra.update(matmul_s=_ms(v.r1.matmul_s), allreduce_s=_ms(v.r1.allreduce_s))
            extra["partner"] = v.r1.partner if v.r1.partner >= 0 else None
        if v.retest is not None:
            extra.update(retest_partner=v.retest.partner)
            extra.update(retest_allreduce_s=_ms(v.retest.allreduce_s))
        events.emit(
            "preflight", member=f"node{n}", ok=v.ok, verdict=v.verdict, seconds=seconds, **extra
        )
        if not v.ok:
            domain = {"rank": None, "node": n}
            how = f"preflight {v.verdict}: {v.detail}"
            events.emit("fault_detected", fault="preflight", domain=domain, latency_s=0.0, how=how)


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
