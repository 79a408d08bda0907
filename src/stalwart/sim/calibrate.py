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

Replaying the calibrated run in the simulator is :mod:`stalwart.sim.replay`.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

from stalwart.errors import ConfigError, StalwartError
from stalwart.metrics.events import Event
from stalwart.metrics.goodput import Goodput
from stalwart.metrics.incidents import Incident
from stalwart.metrics.intervals import measure, union
from stalwart.metrics.report import RunReport, load_run
from stalwart.sim.calibration import COST_KEYS, Calibration, MeasuredRun, Replay, ReplayFault
from stalwart.sim.replay import ReplayResult, replay, replay_scenario
from stalwart.sim.strategies import STRATEGIES, TRAITS

# the replay API lived here first: ``stalwart.sim.calibrate.replay`` keeps working
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

    c = _Costs()
    # Checkpointing.
    doc = rep.to_dict()
    ck = doc["checkpoint"]
    if ck["snapshots"]:
        c.costs["snapshot_stall_s"] = float(ck["mean_stall_s"])
        c.counts["snapshot_stall_s"] = int(ck["snapshots"])
    persists = [e for e in events if e.kind == "persist_end" and e["ok"]]
    c.put("persist_s", [float(e["seconds"]) for e in persists])
    faults = _failure_costs(rep, run_strategy, c, warnings)

    # The run's shape and its replay.
    measured: MeasuredRun | None = None
    if g.ettr is not None:
        measured = MeasuredRun(
            ettr=min(max(g.ettr, 0.0), 1.0),
            wall_s=g.wall_s,
            failures=len(g.failures),
            gpus=max(gpus, 0),
            nodes=max(nodes, 0),
            mtbf_s=doc["mtbf"]["mtbf_s"],
            step_s=_step_s(g),
            persist_bytes_per_s=ck["write_bytes_per_s"],
        )
    persist_every = _cadence(sorted({int(e["step"]) for e in persists})) or 0
    replay_cfg = _replay(rep, run_strategy, persist_every, faults, warnings)
    missing = [
        k for k in COST_KEYS if k not in c.costs and k not in ("sync_save_s", "control_plane_s")
    ]
    source: dict[str, str | int | float] = {
        "run_dir": os.path.abspath(rep.run_dir),
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "events": len(events),
        "strategy": run_strategy,
    }
    if start is not None:
        source["job"] = str(start["job"])
    cal = Calibration(costs=c.costs, source=source, measured=measured, replay=replay_cfg)
    return CalibrationRun(cal, missing, warnings, c.counts)


@dataclass
class _Costs:
    """The costs measured so far and the samples behind each."""

    costs: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def put(self, key: str, values: list[float]) -> None:
        if values:
            self.costs[key] = max(_mean(values), 0.0)
            self.counts[key] = len(values)


def _failure_costs(
    rep: RunReport, run_strategy: str, c: _Costs, warnings: list[str]
) -> list[ReplayFault]:
    """Failures: detection by kind, restore by tier, the rest of the RTO by strategy;
    every failure as a fault of the replay."""
    g, events = rep.goodput, rep.events
    detected = [e for e in events if e.kind == "fault_detected"]
    injected = [e for e in events if e.kind == "fault_injected"]
    restores = [e for e in events if e.kind == "restore"]
    detect: dict[str, list[float]] = {"crash": [], "hang": [], "lease": []}
    tier_s: dict[str, list[float]] = {t: [] for t in _TIERS}
    parts: dict[tuple[str, bool], list[float]] = {}
    faults: list[ReplayFault] = []
    t_train = g.windows[0].t0 if g.windows else g.t_start
    for inc in (i for i in g.failures if i.t_detected is not None):
        kind = _detection_kind(inc, detected, warnings)
        node = _is_node_fault(inc)
        faults.append(
            ReplayFault(max(inc.t_fault - t_train, 0.0), kind, node, _trigger_step(inc, injected))
        )
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
    for kind, values in detect.items():
        c.put(f"detect_{kind}_s", values)
    for tier in _TIERS:
        c.put(f"restore_{tier}_s", tier_s[tier])
    _recovery_costs(parts, c, warnings)
    return faults


def _recovery_costs(
    parts: dict[tuple[str, bool], list[float]], c: _Costs, warnings: list[str]
) -> None:
    """The recovery cost of each strategy, from its recoveries' times (by strategy, and
    whether the failure took a node)."""

    def both(name: str) -> list[float]:
        return parts.get((name, False), []) + parts.get((name, True), [])

    c.put("restart_s", both("restart"))
    c.put("spare_takeover_s", both("spare"))
    c.put("reconfigure_s", both("elastic"))
    c.put("flash_restart_s", parts.get(("flash", False), []))
    node_parts = parts.get(("flash", True), [])
    if node_parts:
        base = c.costs.get("flash_restart_s", 0.0)
        c.costs["node_replace_s"] = max(_mean(node_parts) - base, 0.0)
        c.counts["node_replace_s"] = len(node_parts)
    unknown = sorted({s for s, _ in parts} - set(STRATEGIES))
    if unknown:
        warnings.append(f"recoveries by unknown strategy {', '.join(unknown)}: not calibrated")


def _step_s(g: Goodput) -> float | None:
    nsteps = sum(w.last_step - w.first_step + 1 for w in g.windows)
    busy = math.fsum(w.busy_s for w in g.windows)
    return busy / nsteps if nsteps else None


def _replay(
    rep: RunReport,
    run_strategy: str,
    persist_every: int,
    faults: list[ReplayFault],
    warnings: list[str],
) -> Replay | None:
    """The run's shape for the replay: its startup, training span, step time and cadence
    (None, with a warning, when the run shows too little of them)."""
    g, wins = rep.goodput, rep.goodput.windows
    nsteps = sum(w.last_step - w.first_step + 1 for w in wins)
    busy = math.fsum(w.busy_s for w in wins)
    # Per-step overhead: the "other" time of the training span (inside step batches, and the
    # gaps between them), i.e. the report's other bucket less the shutdown after the last
    # batch.
    tail = max(g.t_end - wins[-1].t1, 0.0) if wins else 0.0
    overhead = max(g.buckets["other"] - tail, 0.0)
    # Snapshot steps: the snapshots logged, and the steps recoveries restored (a snapshot
    # each, even when its event was lost with the process that would have written it).
    snap_steps = sorted(
        {int(e["step"]) for e in rep.events if e.kind == "snapshot"}
        | {
            int(e["restored_step"])
            for e in rep.events
            if e.kind == "recovery_end" and e["restored_step"] is not None
        }
    )
    every = _cadence(snap_steps)
    if not wins or nsteps == 0 or busy <= 0:
        warnings.append("no step batches: step time, cadence and the replay are not measured")
        return None
    if every is None:
        warnings.append("fewer than two snapshots: no snapshot cadence, so no replay section")
        return None
    wall_step = (busy + overhead) / nsteps
    train = wins[-1].t1 - wins[0].t0
    startup = wins[0].t0 - g.t_start  # launch to the first step (a first snapshot too)
    grouped = run_strategy in TRAITS and not TRAITS[run_strategy].pauses_job  # async
    groups, sync_every = _rounds(rep) if grouped else (1, 0)
    if grouped and sync_every == 0:
        warnings.append("fewer than two replica synchronisations: the replay cannot price a fault")
    return Replay(
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
        replica_groups=groups,
        sync_every=sync_every,
    )


def _rounds(rep: RunReport) -> tuple[int, int]:
    """An async run's replica groups and steps between synchronisations, from its
    ``replica_sync`` events (members + dropped: every group; the median gap of steps)."""
    syncs = [e for e in rep.events if e.kind == "replica_sync"]
    groups = max((len(e["members"]) + len(e["dropped"]) for e in syncs), default=1)
    steps = sorted({int(e["step"]) for e in syncs})
    gaps = sorted(b - a for a, b in itertools.pairwise(steps) if b > a)
    return max(groups, 1), (gaps[len(gaps) // 2] if gaps else 0)
