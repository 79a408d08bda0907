"""Checkpoint planner: optimal snapshot and persist intervals, and ETTR at scale.

For each strategy the planner reports Young's and Daly's intervals for the strategy's own stall
(``sync_save_s`` for ``restart``, ``snapshot_stall_s`` otherwise) and the job's MTBF, then searches
the simulator: every candidate interval (a log-spaced grid around Daly's) replays the *same*
sampled failures (common random numbers), and the optimum is the vertex of a quadratic fitted in
log(interval) to the grid points around the best one. The fit averages Monte Carlo noise over
neighbouring intervals, where the ETTR curve is flat (a 5% error in the interval costs ~0.01% of
ETTR); on exponential failures it lands within 1% of Daly's optimum (tests/sim/test_fidelity.py).

Persistence runs in the background for the snapshot strategies, so it costs no stall: the planner
persists every ``ceil(persist_s / (interval + stall))`` snapshots, i.e. as often as the storage can
keep up. ``async`` recovers from a healthy replica, so its ETTR does not depend on the interval.

Scale: :func:`ettr_vs_scale` reruns a scenario at other GPU counts with the same per-GPU (or
per-node) failure rates and the same share of spare nodes (but at least two switches' worth when
the scenario has spares: otherwise one switch fault empties a small pool and the job waits for a
repair), each strategy at its Daly interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from stalwart.errors import ConfigError
from stalwart.sim.analytic import daly_interval, young_interval
from stalwart.sim.engine import Scenario, ettr_by_interval, simulate
from stalwart.sim.failures import sample_failures
from stalwart.sim.strategies import TRAITS, Strategy

__all__ = [
    "Plan",
    "ScalePoint",
    "StrategyPlan",
    "ettr_vs_scale",
    "numeric_optimum",
    "plan",
    "scale_scenario",
]


@dataclass(frozen=True)
class StrategyPlan:
    """Intervals (compute seconds between checkpoints) and ETTR of one strategy."""

    strategy: Strategy
    stall_s: float
    young_s: float
    daly_s: float
    optimum_s: float | None
    persist_every: int
    ettr: float
    ettr_ci95: float
    grid_s: tuple[float, ...]
    curve: tuple[float, ...]


@dataclass(frozen=True)
class Plan:
    scenario: str
    gpus: int
    mtbf_s: float
    replicas: int
    strategies: tuple[StrategyPlan, ...]


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    mtbf_s: float
    ettr: dict[str, float]


def numeric_optimum(intervals: NDArray[np.float64], ettr: NDArray[np.float64]) -> float:
    """Vertex of a quadratic in log(interval) fitted around the best grid point.

    Falls back to the best grid point when the fit is not concave or leaves the fitted window.
    """
    if len(intervals) != len(ettr) or len(intervals) < 3:
        raise ConfigError("need at least 3 intervals with one ETTR each to locate an optimum")
    best = int(np.argmax(ettr))
    lo, hi = max(0, best - 5), min(len(intervals), best + 6)
    x = np.log(intervals[lo:hi])
    if hi - lo < 3:
        return float(intervals[best])
    a, b, _ = np.polyfit(x, ettr[lo:hi], 2)
    if a >= 0:
        return float(intervals[best])
    vertex = -b / (2.0 * a)
    if not x[0] <= vertex <= x[-1]:
        return float(intervals[best])
    return float(math.exp(vertex))


def _stall(scenario: Scenario, strategy: Strategy) -> float:
    durable = TRAITS[strategy].durable_rollback
    return scenario.job.sync_save_s if durable else scenario.job.snapshot_stall_s


def plan(
    scenario: Scenario,
    strategies: tuple[Strategy, ...],
    *,
    replicas: int = 64,
    seed: int = 0,
    points: int = 25,
    span: float = 4.0,
) -> Plan:
    """Young, Daly and the simulated optimum per strategy, on one set of sampled failures."""
    if points < 5:
        raise ConfigError(f"the interval grid needs >= 5 points, got {points}")
    if not span > 1:
        raise ConfigError(f"the grid span must be > 1 (a factor around Daly's), got {span}")
    mtbf = scenario.mtbf_s
    if math.isinf(mtbf):
        raise ConfigError("no failure can happen (all rates are 0): nothing to plan; give a rate")
    rng = np.random.default_rng(seed)
    trace = sample_failures(scenario.cluster, scenario.failures, scenario.horizon_s, replicas, rng)
    out = []
    for strategy in strategies:
        stall = _stall(scenario, strategy)
        daly = daly_interval(stall, mtbf)
        young = young_interval(stall, mtbf)
        centre = max(daly, 1.0)
        grid = centre * np.exp(np.linspace(-math.log(span), math.log(span), points))
        per_replica = ettr_by_interval(scenario, strategy, trace, grid)
        curve = per_replica.mean(axis=1)
        if not TRAITS[strategy].pauses_job:
            optimum: float | None = None
            at = per_replica[points // 2]
        else:
            optimum = numeric_optimum(grid, curve)
            at = ettr_by_interval(scenario, strategy, trace, np.array([optimum]))[0]
        used = optimum if optimum is not None else centre
        persist_every = max(1, math.ceil(scenario.job.persist_s / (used + stall)))
        ci = 1.96 * float(at.std(ddof=1)) / math.sqrt(replicas) if replicas > 1 else math.nan
        out.append(
            StrategyPlan(
                strategy=strategy,
                stall_s=stall,
                young_s=young,
                daly_s=daly,
                optimum_s=optimum,
                persist_every=1 if TRAITS[strategy].durable_rollback else persist_every,
                ettr=float(at.mean()),
                ettr_ci95=ci,
                grid_s=tuple(float(g) for g in grid),
                curve=tuple(float(c) for c in curve),
            )
        )
    return Plan(scenario.name, scenario.cluster.gpus, mtbf, replicas, tuple(out))


def scale_scenario(scenario: Scenario, gpus: int) -> Scenario:
    """``scenario`` on ``gpus`` GPUs: same rates per GPU/node, same share of spare nodes."""
    per_node = scenario.cluster.gpus_per_node
    if gpus < per_node or gpus % per_node:
        raise ConfigError(
            f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes; "
            f"pass a multiple of {per_node} (or change --gpus-per-node)"
        )
    nodes = gpus // per_node
    spares = round(scenario.cluster.spare_nodes * nodes / scenario.cluster.nodes)
    if scenario.cluster.spare_nodes:
        spares = max(spares, 2 * scenario.cluster.nodes_per_switch)
    cluster = replace(scenario.cluster, nodes=nodes, spare_nodes=spares)
    return replace(scenario, cluster=cluster)


def ettr_vs_scale(
    scenario: Scenario,
    strategies: tuple[Strategy, ...],
    sizes: tuple[int, ...],
    *,
    replicas: int = 32,
    seed: int = 0,
) -> tuple[ScalePoint, ...]:
    """Mean ETTR of each strategy at each cluster size (GPUs), at its Daly interval."""
    points = []
    for gpus in sizes:
        scaled = scale_scenario(scenario, gpus)
        result = simulate(scaled, strategies, replicas=replicas, seed=seed)
        points.append(ScalePoint(gpus, scaled.mtbf_s, {r.strategy: r.ettr for r in result.results}))
    return tuple(points)
