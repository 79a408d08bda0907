"""How often to checkpoint (stalwart.checkpoint.interval): Young's and Daly's optimum,
shared by the worker's ``--persist-every -1`` cadence and the simulator's planner."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from stalwart.checkpoint.interval import daly_interval, young_interval
from stalwart.errors import ConfigError
from stalwart.sim import analytic


@pytest.mark.parametrize(("mtbf_h", "expected_min"), [(24.0, 117.0), (6.0, 57.0)])
def test_dalys_own_examples(mtbf_h: float, expected_min: float) -> None:
    """Daly (2006): a 5 min checkpoint and a 24 h MTBF -> 117 min; 6 h -> 57 min."""
    assert daly_interval(300.0, mtbf_h * 3600.0) / 60.0 == pytest.approx(expected_min, abs=1.0)


def test_young_is_the_first_order_term_and_daly_caps_at_the_mtbf() -> None:
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)
    assert daly_interval(300.0, 100.0) == 100.0  # delta >= 2M: checkpoint once per MTBF
    assert daly_interval(1.0, math.inf) == math.inf


@pytest.mark.parametrize(("delta", "mtbf"), [(-1.0, 100.0), (math.nan, 100.0), (1.0, 0.0)])
def test_bad_inputs_name_the_problem(delta: float, mtbf: float) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint cost|MTBF"):
        daly_interval(delta, mtbf)


def test_the_simulator_uses_the_same_formula() -> None:
    assert analytic.daly_interval is daly_interval
    assert analytic.young_interval is young_interval


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_worker_timing_a_persist_loads_no_simulator() -> None:
    """The worker's accounting imports the interval, not the simulator (nor torch)."""
    code = (
        "import sys, stalwart.checkpoint.interval as i; i.daly_interval(1.0, 3600.0); "
        "bad = [m for m in sys.modules if m.startswith('stalwart.sim') or m == 'torch']; "
        "sys.exit(str(bad) if bad else 0)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, timeout=110, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
