"""The simulator's control-plane cost follows the measured curve in N (issue 31): the
presets price each recovery with it at their own node count, scaling a scenario moves
it, and a curve without N-dependence is caught."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from stalwart.errors import ConfigError
from stalwart.sim import preset
from stalwart.sim.controlplane import MEASURED, ControlPlaneCurve, curve_from_bench, load_curve
from stalwart.sim.failures import sample_failures
from stalwart.sim.planner import scale_scenario
from stalwart.sim.strategies import event_costs


def test_the_measured_curve_depends_on_n() -> None:
    """The calibration's N-dependence: several node counts, cost growing with N."""
    nodes = [n for n, _ in MEASURED.points]
    assert len(nodes) >= 3 and nodes[-1] >= 256
    costs = [s for _, s in MEASURED.points]
    assert costs[-1] > costs[0]
    assert MEASURED.at(16_384) > MEASURED.at(2_048) > MEASURED.at(nodes[0])


@pytest.mark.parametrize("name", ["llama3-54d", "meta-rsc1", "meta-rsc2"])
def test_presets_take_the_control_plane_from_the_curve_at_their_node_count(name: str) -> None:
    sc = preset(name)
    assert sc.control_plane is MEASURED
    at_16k = sc.recovery_costs().control_plane_s
    assert at_16k == pytest.approx(MEASURED.at(sc.cluster.nodes))
    big = scale_scenario(sc, 131_072)  # 16,384 nodes: the curve at that N, not a constant
    assert big.recovery_costs().control_plane_s == pytest.approx(MEASURED.at(16_384))
    assert big.recovery_costs().control_plane_s > at_16k
    assert MEASURED.extrapolated(big.cluster.nodes)


def test_a_recovery_pauses_longer_at_more_nodes() -> None:
    sc = preset("meta-rsc1")
    big = scale_scenario(sc, 131_072)
    trace = sample_failures(sc.cluster, sc.failures, sc.horizon_s, 1, np.random.default_rng(0))
    small_pause = event_costs("flash", trace, sc.cluster, sc.job, sc.recovery_costs()).pause
    big_pause = event_costs("flash", trace, sc.cluster, sc.job, big.recovery_costs()).pause
    assert len(small_pause) and np.all(big_pause > small_pause)


def test_interpolation_and_linear_extrapolation() -> None:
    curve = ControlPlaneCurve(((16, 1.0), (64, 2.0), (256, 4.0)))
    assert curve.at(8) == 1.0
    assert curve.at(40) == pytest.approx(1.5)
    assert curve.at(512) == pytest.approx(4.0 + 2.0 / 192 * 256)
    assert not curve.extrapolated(256) and curve.extrapolated(257)
    with pytest.raises(ConfigError, match="sorted"):
        ControlPlaneCurve(((64, 1.0), (16, 2.0)))


def test_curve_from_the_bench_final_line(tmp_path: object) -> None:
    line = {
        "n_max": 64,
        "curves": {
            "embedded": [
                {"n": 64, "loss_to_agreement_s": 1.6},
                {"n": 16, "loss_to_agreement_s": 0.8},
                {"n": 256, "error": "RuntimeError: did not form"},
                {"n": 512, "loss_to_agreement_s": 27.0, "emulator_saturated": True},
            ]
        },
    }
    curve = curve_from_bench(line)
    assert curve.points == ((16, 0.8), (64, 1.6))
    path = tmp_path / "scale.out"  # type: ignore[operator]
    path.write_text('{"n": 16}\n' + json.dumps(line) + "\n")
    assert load_curve(path).points == curve.points
    with pytest.raises(ConfigError, match="etcd"):
        curve_from_bench(line, "etcd")
    assert dataclasses.replace(preset("meta-rsc2"), control_plane=None).recovery_costs() == (
        preset("meta-rsc2").costs
    )
