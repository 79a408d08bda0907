"""The simulator's prediction beside each measured route of ``stalwart compare``.

Each stalwart route's faulted run is calibrated from its own event log
(:func:`stalwart.sim.calibrate.calibrate`: step time, snapshot stall, detection and
recovery per fault kind) and replayed with its own faults at their instants
(:func:`stalwart.sim.replay.replay`), the fidelity check of ``stalwart calibrate``; the
predicted ETTR is shown beside the ETTR the run's report measured. A route the simulator
cannot replay gets a note saying why instead of a number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.errors import StalwartError

__all__ = ["simulate_route"]


def simulate_route(out: Path) -> dict[str, Any]:
    """``{"predicted_ettr", "measured_ettr"}`` of the run in ``out`` (``{"note"}`` if none)."""
    from stalwart.sim.calibrate import calibrate
    from stalwart.sim.replay import replay

    try:
        result = replay(calibrate(str(out / "run")).calibration)
    except StalwartError as err:
        return {"note": f"no simulator replay: {err}"}
    return {"predicted_ettr": result.predicted_ettr, "measured_ettr": result.measured_ettr}
