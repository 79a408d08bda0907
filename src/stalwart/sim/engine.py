"""Monte Carlo engine: replays sampled failures against periodic checkpointing, per strategy.

The loop runs over the k-th failure of every replica at once (numpy arrays over replicas, and
over candidate checkpoint intervals when the planner searches them), so its cost is
``O(max failures per run)`` numpy operations on arrays of ``replicas x intervals`` elements: it
grows with the number of failures and never with the number of GPUs.

Between two failures the job alternates ``interval`` seconds of compute with ``stall`` seconds of
checkpoint, so the work done, the last completed snapshot and the last durable checkpoint follow
in closed form from the length of the failure-free span. A failure rolls the job back to the
snapshot or the durable checkpoint (per strategy) and pauses it; a failure during a pause starts
the recovery again. ETTR is the work kept at the end of the horizon over the horizon (the last
partial interval counts: the run is not interrupted at the end). With exponential failures and
the ``restart`` strategy this is exactly the renewal process of Daly (2006), which the tests check.

Trade-off: elastic and async deficits are subtracted after the loop (capacity-seconds times the
share of time spent computing) instead of stretching the compute inside it; with throughput
linear in live nodes this is exact except for work done at reduced capacity and then rolled back,
which is counted as lost at full capacity (a second-order effect).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from stalwart.errors import ConfigError
from stalwart.sim.analytic import daly_interval
from stalwart.sim.controlplane import ControlPlaneCurve
from stalwart.sim.failures import ClusterConfig, FailureModel, FailureTrace, sample_failures
from stalwart.sim.job import JobConfig, RecoveryCosts
from stalwart.sim.strategies import (
    QUALITY_NOTES,
    TRAITS,
    EventCosts,
    Strategy,
    event_costs,
)

__all__ = [
    "Scenario",
    "SimulationResult",
    "StrategyResult",
    "ettr_by_interval",
    "simulate",
    "strategy_interval",
]


@dataclass(frozen=True)
class Scenario:
    """A cluster, its failures, the job's costs and how long it runs."""

    name: str
    cluster: ClusterConfig
    failures: FailureModel
    job: JobConfig = field(default_factory=JobConfig)
    costs: RecoveryCosts = field(default_factory=RecoveryCosts)
    horizon_s: float = 54 * 86400.0
    source: str = ""
    control_plane: ControlPlaneCurve | None = None
    """The control plane's cost as a function of N (measured); None: ``costs`` as given."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ConfigError(f"run length must be > 0, got {self.horizon_s!r} s; pass --days > 0")

    @property
    def mtbf_s(self) -> float:
        return self.failures.mtbf_s(self.cluster)

    def recovery_costs(self) -> RecoveryCosts:
        """``costs`` with the control plane's share at this cluster's node count."""
        if self.control_plane is None:
            return self.costs
        return replace(self.costs, control_plane_s=self.control_plane.at(self.cluster.nodes))


@dataclass(frozen=True)
class StrategyResult:
    """Monte Carlo summary of one strategy (means over replicas, 95% confidence half-width)."""

    strategy: Strategy
    interval_s: float
    ettr: float
    ettr_ci95: float
    rto_s: float
    idle_share: float
    lost_h: float
    failures: float
    note: str


@dataclass(frozen=True)
class SimulationResult:
    scenario: str
    gpus: int
    days: float
    replicas: int
    mtbf_s: float
    events: int
    results: tuple[StrategyResult, ...]


def strategy_interval(scenario: Scenario, strategy: Strategy) -> float:
    """The checkpoint interval a strategy runs with: the job's, else Daly's for its stall."""
    if scenario.job.interval_s is not None:
        return scenario.job.interval_s
    durable = TRAITS[strategy].durable_rollback
    stall = scenario.job.sync_save_s if durable else scenario.job.snapshot_stall_s
    mtbf = scenario.mtbf_s
    if math.isinf(mtbf):
        return scenario.horizon_s
    return max(daly_interval(stall, mtbf), 1.0)


def _spans(
    trace: FailureTrace, ec: EventCosts, intervals: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Work kept at the horizon and compute done, shaped ``(len(intervals), replicas)``."""
    horizon = trace.horizon_s
    tau = intervals[:, None]
    cyc = tau + ec.stall_s
    shape = (len(intervals), trace.replicas)
    t_ready = np.zeros(shape)
    w_start = np.zeros(shape)
    w_dur = np.zeros(shape)
    compute = np.zeros(shape)
    pe = float(ec.persist_every)
    for k in range(trace.times.shape[1]):
        tf = trace.times[:, k]
        live = tf < horizon
        if not live.any():
            break
        e = np.where(live, np.maximum(tf - t_ready, 0.0), 0.0)
        c = np.floor(e / cyc)
        work = c * tau + np.minimum(e - c * cyc, tau)
        compute += work
        snap = w_start + c * tau
        i0 = np.rint(w_start / tau)
        jd = np.clip(np.floor((e - ec.persist_s) / cyc), 0.0, c)
        jbest = np.floor((i0 + jd) / pe) * pe - i0
        dur_new = np.where(jbest >= 1, w_start + jbest * tau, w_dur)
        restore = np.where(ec.durable[:, k], dur_new, snap)
        w_start = np.where(live, restore, w_start)
        w_dur = np.where(live, dur_new, w_dur)
        t_ready = np.where(live, tf + ec.pause[:, k], t_ready)
    e = np.maximum(horizon - t_ready, 0.0)
    c = np.floor(e / cyc)
    work = c * tau + np.minimum(e - c * cyc, tau)
    return w_start + work, compute + work


def _replica_metrics(
    trace: FailureTrace, ec: EventCosts, intervals: NDArray[np.float64], penalty: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per (interval, replica): ETTR and work lost (full-cluster seconds)."""
    horizon = trace.horizon_s
    finite = np.isfinite(trace.times)
    deficit = np.where(finite, ec.deficit, 0.0).sum(axis=1)[None, :]
    if ec.uses_engine:
        kept, compute = _spans(trace, ec, intervals)
        busy = (intervals / (intervals + ec.stall_s))[:, None]
        kept = np.maximum(kept - deficit * busy, 0.0)
        lost = compute - kept
    else:
        shape = (len(intervals), trace.replicas)
        kept = np.broadcast_to(np.maximum(horizon - deficit, 0.0), shape) * (1.0 - penalty)
        per_event = ec.lost if ec.lost is not None else np.zeros(trace.times.shape)
        lost = np.broadcast_to(per_event.sum(axis=1)[None, :], shape)
    return kept / horizon, lost


def ettr_by_interval(
    scenario: Scenario,
    strategy: Strategy,
    trace: FailureTrace,
    intervals: NDArray[np.float64],
) -> NDArray[np.float64]:
    """ETTR of every replica of ``trace`` at every interval, shaped ``(intervals, replicas)``.

    All intervals see the same failures (common random numbers), so differences between them are
    not sampling noise between independent traces.
    """
    if np.any(~np.isfinite(intervals)) or np.any(intervals <= 0):
        raise ConfigError("checkpoint intervals must be finite and > 0")
    ec = event_costs(strategy, trace, scenario.cluster, scenario.job, scenario.recovery_costs())
    ettr, _ = _replica_metrics(trace, ec, intervals, scenario.job.async_penalty)
    return ettr


def _summarise(
    scenario: Scenario, strategy: Strategy, trace: FailureTrace, interval: float
) -> StrategyResult:
    ec = event_costs(strategy, trace, scenario.cluster, scenario.job, scenario.recovery_costs())
    ettr, lost = _replica_metrics(
        trace, ec, np.array([interval], dtype=np.float64), scenario.job.async_penalty
    )
    e = ettr[0]
    n = trace.replicas
    ci = 1.96 * float(e.std(ddof=1)) / math.sqrt(n) if n > 1 else math.nan
    finite = np.isfinite(trace.times)
    events = int(finite.sum())
    window = float(np.where(finite, ec.window, 0.0).sum())
    idle = float(np.where(finite, ec.pause + ec.deficit, 0.0).sum())
    lost_s = float(lost[0].mean())
    return StrategyResult(
        strategy=strategy,
        interval_s=interval,
        ettr=float(e.mean()),
        ettr_ci95=ci,
        rto_s=float(ec.pause[finite].mean()) if events else 0.0,
        idle_share=idle / window if window > 0 else 0.0,
        lost_h=lost_s / 3600.0,
        failures=events / n,
        note=QUALITY_NOTES[strategy],
    )


def simulate(
    scenario: Scenario,
    strategies: tuple[Strategy, ...],
    *,
    replicas: int = 200,
    seed: int = 0,
    trace: FailureTrace | None = None,
) -> SimulationResult:
    """Run every strategy on the same sampled failures and summarise each."""
    if not strategies:
        raise ConfigError("no strategy to simulate; pass --strategy restart,flash,...")
    if trace is None:
        rng = np.random.default_rng(seed)
        trace = sample_failures(
            scenario.cluster, scenario.failures, scenario.horizon_s, replicas, rng
        )
    results = tuple(
        _summarise(scenario, s, trace, strategy_interval(scenario, s)) for s in strategies
    )
    return SimulationResult(
        scenario=scenario.name,
        gpus=scenario.cluster.gpus,
        days=scenario.horizon_s / 86400.0,
        replicas=trace.replicas,
        mtbf_s=scenario.mtbf_s,
        events=trace.events,
        results=results,
    )
