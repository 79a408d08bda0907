"""The simulator's prediction beside each measured route of ``stalwart compare``.

Each stalwart route's faulted run is calibrated from its own event log
(:func:`stalwart.sim.calibrate.calibrate`: step time, snapshot stall, detection and
recovery per fault kind) and replayed with its own faults at their instants
(:func:`stalwart.sim.replay.replay`), the fidelity check of ``stalwart calibrate``; the
predicted ETTR is shown beside the ETTR the run's report measured.

torchrun and torchft write no event log, so their calibration is built from what compare
measured of them, with the median RTO as the one recovery cost, the fault-free step time,
and the faults at the instants they fired: torchrun as the simulator's ``restart`` strategy
(everyone restarted, rolled back to the last checkpoint: the RTO holds detection, relaunch
and the script's torch.load, a checkpoint every ``save_every`` steps); torchft as a
recovery in place that rolls nothing back (``elastic`` with the process fault cured in
place and a snapshot every step: the job pauses for the RTO, the survivors' wait for the
dead group to be dropped from the quorum, and loses no step, the killed group healing
from a live one). Each is compared with the same wall-clock ETTR (productive time, the
fault-free span, over the faulted run's launch-to-exit). A route the simulator cannot
replay gets a note saying why instead of a number.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from stalwart.errors import StalwartError
from stalwart.metrics.routes import RouteRun, recoveries

__all__ = ["simulate_injected", "simulate_route"]


def simulate_route(out: Path) -> dict[str, Any]:
    """``{"predicted_ettr", "measured_ettr"}`` of the run in ``out`` (``{"note"}`` if none)."""
    from stalwart.sim.calibrate import calibrate
    from stalwart.sim.replay import replay

    try:
        result = replay(calibrate(str(out / "run")).calibration)
    except StalwartError as err:
        return {"note": f"no simulator replay: {err}"}
    return {"predicted_ettr": result.predicted_ettr, "measured_ettr": result.measured_ettr}


def simulate_injected(
    run: RouteRun, free: RouteRun, launcher: str, save_every: int
) -> dict[str, Any]:
    """The replay of a torchrun or torchft run from compare's own measurements (above)."""
    from stalwart.sim.calibration import Calibration, MeasuredRun, Replay, ReplayFault
    from stalwart.sim.replay import replay

    rtos = [r.rto_s for r in recoveries(run.records, run.faults_at) if r.rto_s is not None]
    span, ff_span = run.span_s, free.span_s
    if not run.reached or span is None or ff_span is None or not run.records:
        return {"note": "no simulator replay: the run did not reach its target"}
    step_s = ff_span / max(len({r.step for r in free.records}) - 1, 1)
    t0, wall = run.records[0].t, run.exited - run.launched
    faults = tuple(ReplayFault(t - t0, "crash", False) for t in run.faults_at if t >= t0)
    rto = statistics.median(rtos) if rtos else 0.0
    in_place = launcher == "torchft"  # heals from a live group: nothing rolled back
    every = 1 if in_place else save_every
    replay_cfg = Replay(
        strategy="elastic" if in_place else "restart",
        startup_s=t0 - run.launched,
        train_s=span,
        tail_s=max(run.exited - run.records[-1].t, 0.0),
        step_s=step_s,
        efficiency=1.0,
        snapshot_every=every,
        interval_s=every * step_s,
        persist_every=every,
        faults=faults,
    )
    costs = {"detect_crash_s": 0.0, ("flash_restart_s" if in_place else "restart_s"): rto}
    costs |= {"restore_disk_s": 0.0, "restore_remote_s": 0.0, "snapshot_stall_s": 0.0}
    costs |= {"restore_memory_s": 0.0, "restore_peer_s": 0.0}
    measured = MeasuredRun(ettr=min(ff_span / wall, 1.0), wall_s=wall, failures=len(faults),
                           gpus=run.workers, nodes=1)  # fmt: skip
    cal = Calibration(costs=costs, source={"run_dir": launcher}, measured=measured,
                      replay=replay_cfg)  # fmt: skip
    try:
        result = replay(cal)
    except StalwartError as err:
        return {"note": f"no simulator replay: {err}"}
    return {"predicted_ettr": result.predicted_ettr, "measured_ettr": result.measured_ettr}
