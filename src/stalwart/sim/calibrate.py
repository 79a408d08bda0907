"""``stalwart calibrate RUN_DIR``: a real run's measured costs, as a calibration file.

Every figure comes from the run's event log through :mod:`stalwart.metrics` (the same
accounting as ``stalwart report``: incidents, buckets, step batches), never from a second
reading of the raw events, so a calibration file and the report of its run cannot disagree.

What is measured (docs/simulator.md, "Calibration"):

* ``snapshot_stall_s``: mean snapshot stall (the report's stall bucket over its snapshots);
  ``persist_s``: mean time of a committed persist, and its bandwidth.
* ``detect_crash_s``, ``detect_hang_s``, ``detect_lease_s``: mean detection latency of the
  failures detected as a process crash, a hang (no step progress) and a lost node (lease
  expiry).
* Per failure, its RTO (fault to the first step after it) is split into detection, restore
  (the time covered by its ``restore`` events, by the tier recovery reported) and the rest,
  the strategy's own recovery: ``restart_s`` (restart), ``flash_restart_s`` (flash, a
  process fault), ``node_replace_s`` (flash, what a node fault takes beyond a process fault),
  ``spare_takeover_s`` (spare), ``reconfigure_s`` (elastic); restore per tier:
  ``restore_memory_s``, ``restore_peer_s``, ``restore_disk_s``, ``restore_remote_s``.
  Failures that overlap another one are left out of these means (their parts are shared).
* ``measured``: ETTR, wall time, failures, MTBF, step time, GPUs, nodes, persist bandwidth.
* ``replay``: the run's own configuration (startup, length, step time, snapshot and persist
  cadence, and every failure's time, detection kind and domain), for :func:`replay`.

``sync_save_s`` is never written: stalwart does not save synchronously, so a run cannot
measure it (pass ``--sync-save-s`` to compare with a torch.save baseline).

Replaying a run (the fidelity check of issue 6): the simulator's engine runs the run's
configuration with its calibrated costs, and the failure process is the run's own failures
at the times they struck (chaos injected them deterministically, at a step or a time, so
"the same configuration" is the same faults at the same moments, not a Poisson process with
the same rate: a 40-second run with three faults says nothing about a rate, and sampling one
would test the dice rather than the cost model). Start-up and shutdown, which the engine does
not model, are fixed costs around the training span, and per-step overhead (data loading,
logging) is the measured share ``1 - efficiency`` of training time.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np

from stalwart.errors import ConfigError, StalwartError
from stalwart.metrics._intervals import measure, union
from stalwart.metrics.events import Event
from stalwart.metrics.incidents import Incident
from stalwart.metrics.report import RunReport, load_run
from stalwart.sim.calibration import (
    COST_KEYS,
    Calibration,
    MeasuredRun,
    Replay,
    ReplayFault,
    apply_calibration,
)
from stalwart.sim.engine import Scenario, ettr_by_interval
from stalwart.sim.failures import ClusterConfig, FailureCause, FailureModel, FailureTrace
from stalwart.sim.job import JobConfig, RecoveryCosts
from stalwart.sim.strategies import STRATEGIES, Strategy

__all__ = [
    "CalibrationRun",
    "ReplayResult",
    "calibrate",
    "calibrate_report",
    "replay",
    "replay_scenario",
]

_TIERS = ("memory", "peer", "disk", "remote")
# A detector's fault name (fault_detected.fault) -> the simulator's detection kind.
_DETECTED_KIND = {"crash": "crash", "hang": "hang", "node_loss": "lease"}
# A chaos fault name (fault_injected.fault) -> the detection kind it normally gets.
_INJECTED_KIND = {"kill": "crash", "hang": "hang", "node_kill": "lease", "node_hang": "lease"}
_AT_STEP = re.compile(r"\bat=step:(\d+)\b")


@dataclass
class CalibrationRun:
    """A calibration derived from one run, plus what could not be measured and why."""

    calibration: Calibration
    missing: list[str]  # cost keys the run did not measure (the preset's values stay)
    warnings: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # samples behind each cost


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


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def _detection_kind(inc: Incident, detected: list[Event], warnings: list[str]) -> str:
    """crash / hang / lease: how the failure was noticed (nearest detection event)."""
    if inc.t_detected is not None and detected:
        near = min(detected, key=lambda e: abs(e.t - float(inc.t_detected or 0.0)))
        if abs(near.t - inc.t_detected) < 1e-3 and str(near["fault"]) in _DETECTED_KIND:
            return _DETECTED_KIND[str(near["fault"])]
    if inc.fault in _INJECTED_KIND:
        return _INJECTED_KIND[inc.fault]
    if inc.fault in _DETECTED_KIND:
        return _DETECTED_KIND[inc.fault]
    warnings.append(f"failure {inc.index} ({inc.fault}): unknown detection kind, counted as crash")
    return "crash"


def _trigger_step(inc: Incident, injected: list[Event]) -> int | None:
    """The step chaos injected ``inc`` at (``at=step:N`` in its spec), if it did."""
    if not inc.injected or not injected:
        return None
    near = min(injected, key=lambda e: abs(e.t - inc.t_fault))
    if abs(near.t - inc.t_fault) >= 1e-3:
        return None
    m = _AT_STEP.search(str(near.get("spec", "")))
    return None if m is None else int(m.group(1))


def _is_node_fault(inc: Incident) -> bool:
    return inc.domain.get("rank") is None and inc.domain.get("node") is not None


def _cadence(steps: list[int]) -> int | None:
    """Steps per snapshot, from the sorted steps snapshots were taken at.

    A run takes its first snapshots at every step while it measures its own cadence; that
    leading run of consecutive steps is left out. The rest are spread evenly: their mean
    spacing is the cadence (under restart, snapshots and persists interleave, and the mean
    spacing is what the stall costs). With one steady snapshot its step is the cadence
    (snapshots fall on multiples of it).
    """
    if not steps:
        return None
    n = 1
    while n < len(steps) and steps[n] == steps[n - 1] + 1:
        n += 1
    steady = steps[n:]
    if len(steady) >= 2:
        return max(round((steady[-1] - steady[0]) / (len(steady) - 1)), 1)
    if steady:
        return max(steady[0], 1)
    return 1 if n >= 2 else None


def calibrate(run_dir: str) -> CalibrationRun:
    """Read ``RUN_DIR/events.jsonl`` and derive a calibration (ConfigError if unusable)."""
    try:
        rep = load_run(run_dir)
    except StalwartError as err:
        raise ConfigError(f"cannot calibrate: {err}") from err
    return calibrate_report(rep)


def calibrate_report(rep: RunReport) -> CalibrationRun:
    """The calibration of an already computed run report."""
    g = rep.goodput
    events = rep.events
    warnings: list[str] = []
    if rep.partial:
        warnings.append(
            "partial event log ("
            + "; ".join(rep.problems[:2])
            + "): calibrating what it shows; figures cover the logged part only"
        )
    start = next((e for e in events if e.kind == "run_start"), None)
    run_strategy = str(start.get("strategy") or "restart") if start is not None else "restart"
    top = max((n for _, n in g.world_sizes), default=0)
    gpus = int(start["world_size"]) if start is not None else top
    nodes = int(start.get("nnodes") or 1) if start is not None else 1

    costs: dict[str, float] = {}
    counts: dict[str, int] = {}

    def put(key: str, values: list[float]) -> None:
        if values:
            costs[key] = max(_mean(values), 0.0)
            counts[key] = len(values)

    # Checkpointing.
    doc = rep.to_dict()
    ck = doc["checkpoint"]
    if ck["snapshots"]:
        costs["snapshot_stall_s"] = float(ck["mean_stall_s"])
        counts["snapshot_stall_s"] = int(ck["snapshots"])
    persists = [e for e in events if e.kind == "persist_end" and e["ok"]]
    put("persist_s", [float(e["seconds"]) for e in persists])

    # Failures: detection by kind, restore by tier, the rest of the RTO by strategy.
    detected = [e for e in events if e.kind == "fault_detected"]
    injected = [e for e in events if e.kind == "fault_injected"]
    restores = [e for e in events if e.kind == "restore"]
    fails = [i for i in g.failures if i.t_detected is not None]
    detect: dict[str, list[float]] = {"crash": [], "hang": [], "lease": []}
    tier_s: dict[str, list[float]] = {t: [] for t in _TIERS}
    parts: dict[tuple[str, bool], list[float]] = {}
    faults: list[ReplayFault] = []
    t_train = g.windows[0].t0 if g.windows else g.t_start
    for inc in fails:
        kind = _detection_kind(inc, detected, warnings)
        node = _is_node_fault(inc)
        step = _trigger_step(inc, injected)
        faults.append(ReplayFault(max(inc.t_fault - t_train, 0.0), kind, node, step))
        if inc.overlaps or inc.during_recovery:
            warnings.append(
                f"failure {inc.index} overlaps failure(s) {inc.overlaps or '-'}: left out of "
                "the recovery costs (its parts are shared)"
            )
            continue
        lat = inc.detection_latency_s
        if lat is not None:
            detect[kind].append(max(lat, 0.0))
        if inc.t_resume is None or inc.t_detected is None:
            warnings.append(f"failure {inc.index}: the run never resumed; no recovery cost")
            continue
        a, b = inc.t_detected, inc.t_resume
        mine = [e for e in restores if a <= e.t <= b]
        span = measure(union((e.t - float(e["seconds"]), e.t) for e in mine), a, b)
        tier = inc.source_tier
        if tier not in _TIERS:
            tier = str(max(mine, key=lambda e: float(e["seconds"]))["tier"]) if mine else ""
        if tier in _TIERS:
            tier_s[tier].append(span)
        strategy = inc.strategy or run_strategy
        parts.setdefault((strategy, node), []).append(max(b - a - span, 0.0))
    put("detect_crash_s", detect["crash"])
    put("detect_hang_s", detect["hang"])
    put("detect_lease_s", detect["lease"])
    for tier in _TIERS:
        put(f"restore_{tier}_s", tier_s[tier])
    for strategy, key in (("restart", "restart_s"), ("spare", "spare_takeover_s")):
        put(key, parts.get((strategy, False), []) + parts.get((strategy, True), []))
    put("reconfigure_s", parts.get(("elastic", False), []) + parts.get(("elastic", True), []))
    put("flash_restart_s", parts.get(("flash", False), []))
    node_parts = parts.get(("flash", True), [])
    if node_parts:
        base = costs.get("flash_restart_s", 0.0)
        costs["node_replace_s"] = max(_mean(node_parts) - base, 0.0)
        counts["node_replace_s"] = len(node_parts)
    unknown = sorted({s for s, _ in parts} - set(STRATEGIES))
    if unknown:
        warnings.append(f"recoveries by unknown strategy {', '.join(unknown)}: not calibrated")

    # The run's shape and its replay.
    measured: MeasuredRun | None = None
    ettr = g.ettr
    m = doc["mtbf"]
    wins = g.windows
    nsteps = sum(w.last_step - w.first_step + 1 for w in wins)
    busy = math.fsum(w.busy_s for w in wins)
    # Per-step overhead: the "other" time of the training span (inside step batches, and the
    # gaps between them), i.e. the report's other bucket less the shutdown after the last
    # batch.
    tail = max(g.t_end - wins[-1].t1, 0.0) if wins else 0.0
    overhead = max(g.buckets["other"] - tail, 0.0)
    step_s = busy / nsteps if nsteps else None
    if ettr is not None:
        measured = MeasuredRun(
            ettr=min(max(ettr, 0.0), 1.0),
            wall_s=g.wall_s,
            failures=len(g.failures),
            gpus=max(gpus, 0),
            nodes=max(nodes, 0),
            mtbf_s=m["mtbf_s"],
            step_s=step_s,
            persist_bytes_per_s=ck["write_bytes_per_s"],
        )
    replay_cfg: Replay | None = None
    # Snapshot steps: the snapshots logged, and the steps recoveries restored (a snapshot
    # each, even when its event was lost with the process that would have written it).
    snap_steps = sorted(
        {int(e["step"]) for e in events if e.kind == "snapshot"}
        | {int(e["restored_step"]) for e in events if e.kind == "recovery_end"}
    )
    every = _cadence(snap_steps)
    if not wins or nsteps == 0 or busy <= 0:
        warnings.append("no step batches: step time, cadence and the replay are not measured")
    elif every is None:
        warnings.append("fewer than two snapshots: no snapshot cadence, so no replay section")
    else:
        wall_step = (busy + overhead) / nsteps
        train = wins[-1].t1 - wins[0].t0
        startup = wins[0].t0 - g.t_start  # launch to the first step (a first snapshot too)
        persist_every = _cadence(sorted({int(e["step"]) for e in persists})) or 0
        replay_cfg = Replay(
            strategy=run_strategy,
            startup_s=max(startup, 0.0),
            train_s=max(train, wall_step),
            tail_s=tail,
            step_s=wall_step,
            efficiency=busy / (busy + overhead),
            snapshot_every=every,
            interval_s=every * wall_step,
            persist_every=persist_every,
            faults=tuple(faults),
        )
    missing = [k for k in COST_KEYS if k not in costs and k != "sync_save_s"]
    source: dict[str, str | int | float] = {
        "run_dir": os.path.abspath(rep.run_dir),
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "events": len(events),
        "strategy": run_strategy,
    }
    if start is not None:
        source["job"] = str(start["job"])
    cal = Calibration(costs=costs, source=source, measured=measured, replay=replay_cfg)
    return CalibrationRun(cal, missing, warnings, counts)


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
        replace=(np.ones(shape, dtype=bool) if strategy == "spare" else node) & finite,
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
        times.append(t if t < rp.train_s else math.inf)
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
    if strategy == "restart" and rp.persist_every > 0:
        # stalwart's restart rolls back to the last persisted checkpoint: a checkpoint
        # (for the engine) is a persist, and its stall is that of the snapshots between.
        interval = rp.persist_every * rp.step_s
        sync_save = stall * max(rp.persist_every / rp.snapshot_every, 1.0)
    sc = Scenario(
        name="replay",
        cluster=ClusterConfig(nodes=nodes, gpus_per_node=per_node, spare_nodes=len(rp.faults)),
        failures=FailureModel((FailureCause("replayed", 0.0),)),
        job=JobConfig(interval_s=interval, snapshot_stall_s=stall, sync_save_s=sync_save),
        costs=zero,
        horizon_s=rp.train_s,
        source=f"replay of {cal.source.get('run_dir', '?')}",
    )
    sc = apply_calibration(sc, cal)
    if strategy == "spare" and "restore_peer_s" not in cal.costs:
        # The engine restores a taken-over rank from the peer tier; a standby on the failed
        # rank's own node reads the node's shared memory, which is what the run measured.
        mem = cal.costs.get("restore_memory_s", 0.0)
        sc = replace(sc, costs=replace(sc.costs, restore_peer_s=mem))
    if strategy == "restart":
        remote = cal.costs.get("restore_remote_s", cal.costs.get("restore_disk_s", 0.0))
        sc = replace(
            sc,
            costs=replace(sc.costs, restore_remote_s=remote),
            job=replace(sc.job, sync_save_s=sync_save),
        )
    return sc, _replay_trace(sc, rp, strategy, interval), strategy, interval


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
