"""Replaying a calibrated run in the simulator (``stalwart calibrate`` prints it).

Replaying a run (the fidelity check of issue 6): the simulator's engine runs the run's
configuration with its calibrated costs, and the failure process is the run's own failures
at the times they struck (chaos injected them deterministically, at a step or a time, so
"the same configuration" is the same faults at the same moments, not a Poisson process with
the same rate: a 40-second run with three faults says nothing about a rate, and sampling one
would test the dice rather than the cost model). Start-up and shutdown, which the engine does
not model, are fixed costs around the training span, and per-step overhead (data loading,
logging) is the measured share ``1 - efficiency`` of training time.

The calibration itself (what a run measured) is :mod:`stalwart.sim.calibrate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from stalwart.errors import ConfigError
from stalwart.sim.calibration import Calibration, Replay, apply_calibration
from stalwart.sim.engine import Scenario, ettr_by_interval
from stalwart.sim.failures import ClusterConfig, FailureCause, FailureModel, FailureTrace
from stalwart.sim.job import JobConfig, RecoveryCosts
from stalwart.sim.strategies import STRATEGIES, TRAITS, Strategy

__all__ = ["ReplayResult", "replay", "replay_scenario"]


@dataclass(frozen=True)
class ReplayResult:
    """A simulation of the calibrated run's own configuration, against its measured ETTR."""

    strategy: Strategy
    predicted_ettr: float
    measured_ettr: float | None
    engine_ettr: float  # the engine's ETTR over the training span (before start-up, overhead)
    interval_s: float
    failures: int

    @property
    def error_pp(self) -> float | None:
        """Predicted minus measured ETTR, in percentage points."""
        if self.measured_ettr is None:
            return None
        return 100.0 * (self.predicted_ettr - self.measured_ettr)


def _trace(rp: Replay, strategy: Strategy, times: list[float]) -> FailureTrace:
    """A one-replica trace of the run's faults (in their order) at ``times``."""
    faults = rp.faults
    shape = (1, len(faults))

    def row(values: list[Any], dtype: Any) -> Any:
        return np.array([values], dtype=dtype).reshape(shape)

    node = row([f.node for f in faults], bool)
    # Under spare every failed rank is taken over by a standby; elsewhere a process fault is
    # cured in place and only a lost node leaves the job.
    finite = np.isfinite(row(times, np.float64))
    return FailureTrace(
        horizon_s=rp.train_s,
        times=row(times, np.float64),
        cause=np.zeros(shape, dtype=np.int64),
        nodes_lost=np.ones(shape, dtype=np.int64),
        replace=(np.ones(shape, dtype=bool) if TRAITS[strategy].takes_over else node) & finite,
        hang=row([f.kind == "hang" for f in faults], bool) & finite,
        repair_s=np.full(shape, 10.0 * rp.train_s + 1.0),
        spare_ok=np.ones(shape, dtype=bool),
        uniform=np.full(shape, 0.5),
        count=np.array([int(finite.sum())], dtype=np.int64),
        lease=row([f.kind == "lease" for f in faults], bool) & finite,
    )


def _replay_trace(sc: Scenario, rp: Replay, strategy: Strategy, interval: float) -> FailureTrace:
    """The run's failures as the engine's trace.

    A fault chaos injected at step N strikes when the *simulated* job begins step N (its
    kept work reaches N - 1 steps), so rollbacks land where the run's did; any other fault at
    its measured time after training started. Placing step-triggered faults needs the pauses
    and rollbacks of the faults before them, so they are placed one by one with the engine's
    own rules (compute and stall alternate from the restored work; a failure rolls back to the
    last snapshot, or the last checkpoint under restart, and pauses the job).
    """
    from stalwart.sim.strategies import event_costs

    provisional = _trace(rp, strategy, [f.t_s for f in rp.faults])
    ec = event_costs(strategy, provisional, sc.cluster, sc.job, sc.costs)
    tau = interval
    stall = ec.stall_s
    t_ready, work = 0.0, 0.0
    times: list[float] = []
    for k, f in enumerate(rp.faults):
        if f.step is None:
            t = f.t_s
            x = max((t - t_ready) - math.floor((t - t_ready) / (tau + stall)) * stall, 0.0)
        else:
            x = max((f.step - 1) * rp.step_s - work, 0.0)
            t = t_ready + x + math.floor(x / tau) * stall
        t = max(t, times[-1] if times else 0.0)
        if t >= rp.train_s:  # past the training span: so is every later fault
            times.extend([math.inf] * (len(rp.faults) - k))
            break
        times.append(t)
        work += math.floor(x / tau) * tau  # back to the last checkpoint before the fault
        t_ready = t + float(ec.pause[0, k])
    order = sorted(range(len(times)), key=lambda i: times[i])
    rp_sorted = replace(rp, faults=tuple(rp.faults[i] for i in order))
    return _trace(rp_sorted, strategy, [times[i] for i in order])


def replay_scenario(cal: Calibration) -> tuple[Scenario, FailureTrace, Strategy, float]:
    """The calibrated run's configuration as a scenario, its failures as a one-replica trace,
    its strategy and checkpoint interval (seconds of training between checkpoints)."""
    rp = cal.replay
    if rp is None:
        raise ConfigError(
            "the calibration has no 'replay' section (the run logged no step batches or "
            "fewer than two snapshots); calibrate a run that trained"
        )
    match = [s for s in STRATEGIES if s == rp.strategy]
    if not match:
        raise ConfigError(
            f"cannot replay strategy {rp.strategy!r}; the simulator knows {', '.join(STRATEGIES)}"
        )
    strategy = match[0]
    m = cal.measured
    nodes = max(m.nodes, 1) if m is not None else 1
    per_node = max((m.gpus if m is not None else 1) // nodes, 1)
    # Costs the run did not exercise are zero here: the replay has no other failures.
    zero = RecoveryCosts(**dict.fromkeys(RecoveryCosts.__dataclass_fields__, 0.0))
    stall = cal.costs.get("snapshot_stall_s", 0.0)
    interval = rp.interval_s
    sync_save = stall
    if TRAITS[strategy].durable_rollback and rp.persist_every > 0:
        # stalwart's restart rolls back to the last persisted checkpoint: a checkpoint
        # (for the engine) is a persist, and its stall is that of the snapshots between.
        interval = rp.persist_every * rp.step_s
        sync_save = stall * max(rp.persist_every / rp.snapshot_every, 1.0)
    job = JobConfig(interval_s=interval, snapshot_stall_s=stall, sync_save_s=sync_save)
    if not TRAITS[strategy].pauses_job:  # async: replica groups, a fault stops one
        nodes, per_node, job = _async_shape(rp, m.gpus if m is not None else 1, job)
    sc = Scenario(
        name="replay",
        cluster=ClusterConfig(nodes=nodes, gpus_per_node=per_node, spare_nodes=len(rp.faults)),
        failures=FailureModel((FailureCause("replayed", 0.0),)),
        job=job,
        costs=zero,
        horizon_s=rp.train_s,
        source=f"replay of {cal.source.get('run_dir', '?')}",
    )
    sc = apply_calibration(sc, cal)
    if TRAITS[strategy].takes_over and "restore_peer_s" not in cal.costs:
        # The engine restores a taken-over rank from the peer tier; a standby on the failed
        # rank's own node reads the node's shared memory, which is what the run measured.
        mem = cal.costs.get("restore_memory_s", 0.0)
        sc = replace(sc, costs=replace(sc.costs, restore_peer_s=mem))
    if TRAITS[strategy].durable_rollback:
        remote = cal.costs.get("restore_remote_s", cal.costs.get("restore_disk_s", 0.0))
        sc = replace(
            sc,
            costs=replace(sc.costs, restore_remote_s=remote),
            job=replace(sc.job, sync_save_s=sync_save),
        )
    return sc, _replay_trace(sc, rp, strategy, interval), strategy, interval


def _async_shape(rp: Replay, gpus: int, job: JobConfig) -> tuple[int, int, JobConfig]:
    """An async run as the engine models it: each replica group one simulated node (a
    fault stops one group: 1/G of the job), the sync interval the run's H steps, and no
    convergence penalty: the replay prices time, as the run's report measures ETTR; what
    async costs in quality is the loss gap, measured beside it (docs/routes.md)."""
    groups = max(rp.replica_groups, 1)
    sync_s = rp.sync_every * rp.step_s if rp.sync_every > 0 else job.async_sync_interval_s
    job = replace(job, async_group_nodes=1, async_sync_interval_s=sync_s, async_penalty=0.0)
    return groups, max(gpus // groups, 1), job


def replay(cal: Calibration) -> ReplayResult:
    """Simulate the calibrated run's own configuration; compare with its measured ETTR."""
    sc, trace, strategy, interval = replay_scenario(cal)
    rp = cal.replay
    assert rp is not None  # replay_scenario checked
    engine = float(ettr_by_interval(sc, strategy, trace, np.array([interval]))[0, 0])
    wall = rp.startup_s + rp.train_s + rp.tail_s
    predicted = engine * rp.efficiency * rp.train_s / wall
    return ReplayResult(
        strategy=strategy,
        predicted_ettr=predicted,
        measured_ettr=None if cal.measured is None else cal.measured.ettr,
        engine_ettr=engine,
        interval_s=interval,
        failures=trace.events,
    )
