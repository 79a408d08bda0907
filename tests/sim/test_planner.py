from __future__ import annotations

import numpy as np
import pytest

from stalwart.errors import ConfigError
from stalwart.sim import daly_interval, preset
from stalwart.sim.planner import ettr_vs_scale, numeric_optimum, plan, scale_scenario

from .conftest import daly_scenario


def test_numeric_optimum_finds_a_parabola_vertex() -> None:
    x = np.exp(np.linspace(0.0, 4.0, 21))
    y = 1.0 - (np.log(x) - 2.3) ** 2
    assert numeric_optimum(x, y) == pytest.approx(np.exp(2.3), rel=1e-6)


def test_numeric_optimum_falls_back_to_the_best_point_on_a_monotone_curve() -> None:
    x = np.arange(1.0, 11.0)
    assert numeric_optimum(x, x) == 10.0


def test_plan_restart_optimum_is_near_daly() -> None:
    mtbf, delta = 6 * 3600.0, 300.0
    sc = daly_scenario(mtbf, delta, 600.0, horizon_s=200 * mtbf)
    (p,) = plan(sc, ("restart",), replicas=200, seed=2).strategies
    assert p.daly_s == pytest.approx(daly_interval(delta, mtbf))
    assert p.optimum_s is not None
    assert p.optimum_s == pytest.approx(p.daly_s, rel=0.05)
    assert len(p.grid_s) == len(p.curve) == 25
    assert p.ettr == pytest.approx(max(p.curve), abs=0.002)


def test_plan_persists_as_often_as_storage_allows() -> None:
    sc = preset("llama3-54d")
    sc = sc.__class__(**{**sc.__dict__, "job": sc.job.__class__(persist_s=600.0)})
    flash = plan(sc, ("flash",), replicas=8).strategies[0]
    assert flash.optimum_s is not None
    assert flash.persist_every == int(np.ceil(600.0 / (flash.optimum_s + flash.stall_s)))
    assert flash.persist_every > 1


def test_scale_keeps_rates_per_gpu_and_rejects_partial_nodes() -> None:
    sc = preset("llama3-54d")
    big = scale_scenario(sc, 131072)
    assert big.mtbf_s == pytest.approx(sc.mtbf_s / 8)
    assert big.cluster.spare_nodes == 8 * sc.cluster.spare_nodes
    with pytest.raises(ConfigError, match="whole number"):
        scale_scenario(sc, 1001)


def test_restart_ettr_falls_with_scale() -> None:
    points = ettr_vs_scale(preset("llama3-54d"), ("restart", "spare"), (4096, 65536), replicas=8)
    small, large = points
    assert large.ettr["restart"] < small.ettr["restart"] - 0.05
    assert large.ettr["spare"] > large.ettr["restart"]


def test_plan_without_failures_is_an_error() -> None:
    sc = daly_scenario(3600.0, 10.0, 10.0, 86400.0)
    cause = sc.failures.causes[0].__class__("none", 0.0)
    empty = sc.__class__(**{**sc.__dict__, "failures": sc.failures.__class__((cause,))})
    with pytest.raises(ConfigError, match="nothing to plan"):
        plan(empty, ("restart",))
