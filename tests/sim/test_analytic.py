from __future__ import annotations

import math

import pytest

from stalwart.errors import ConfigError
from stalwart.sim import (
    daly_interval,
    expected_ettr,
    expected_wall_time,
    optimal_interval,
    young_interval,
)


def test_young_is_sqrt_2_delta_m() -> None:
    assert young_interval(300.0, 86400.0) == pytest.approx(math.sqrt(2 * 300 * 86400))


@pytest.mark.parametrize(
    ("mtbf_min", "expected_min", "tol"),
    [(24 * 60, 117.0, 0.5), (6 * 60, 57.0, 0.5), (15, 9.1, 0.05)],
)
def test_daly_reproduces_his_examples(mtbf_min: float, expected_min: float, tol: float) -> None:
    # Daly (2006): a 5-minute checkpoint with MTBF 24 h, 6 h and 15 min.
    assert daly_interval(5 * 60.0, mtbf_min * 60.0) / 60.0 == pytest.approx(expected_min, abs=tol)


def test_daly_caps_at_mtbf_when_checkpoint_is_long() -> None:
    assert daly_interval(100.0, 40.0) == 40.0


@pytest.mark.parametrize("mtbf", [900.0, 21600.0, 86400.0])
def test_exact_optimum_minimises_the_closed_form(mtbf: float) -> None:
    tau = optimal_interval(300.0, mtbf)
    best = expected_wall_time(1.0, tau, 300.0, 60.0, mtbf)
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert expected_wall_time(1.0, tau * factor, 300.0, 60.0, mtbf) > best
    assert tau == pytest.approx(daly_interval(300.0, mtbf), rel=0.01)


def test_wall_time_without_failures_is_work_plus_checkpoints() -> None:
    assert expected_wall_time(1000.0, 100.0, 10.0, 50.0, math.inf) == pytest.approx(1100.0)


def test_ettr_falls_with_restart_cost() -> None:
    assert expected_ettr(600.0, 30.0, 600.0, 3600.0) < expected_ettr(600.0, 30.0, 60.0, 3600.0)


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="MTBF"):
        young_interval(10.0, 0.0)
    with pytest.raises(ConfigError, match="checkpoint cost"):
        daly_interval(-1.0, 100.0)
    with pytest.raises(ConfigError, match="interval"):
        expected_wall_time(1.0, 0.0, 1.0, 1.0, 100.0)
