"""Cluster simulator and checkpoint planner.

Monte Carlo over replicas of a job on a failing cluster, for every recovery strategy of
DESIGN.md (restart, flash, spare, elastic, async), plus the Young/Daly closed forms. See
docs/simulator.md for the model, the formulas and the sources of the presets.
"""

from __future__ import annotations

from stalwart.sim.analytic import (
    daly_interval,
    expected_ettr,
    expected_wall_time,
    optimal_interval,
    young_interval,
)
from stalwart.sim.engine import (
    Scenario,
    SimulationResult,
    StrategyResult,
    ettr_by_interval,
    simulate,
    strategy_interval,
)
from stalwart.sim.failures import (
    ClusterConfig,
    FailureCause,
    FailureModel,
    FailureTrace,
    sample_failures,
)
from stalwart.sim.job import JobConfig, RecoveryCosts
from stalwart.sim.presets import PRESETS, preset
from stalwart.sim.strategies import STRATEGIES, Strategy, parse_strategies

__all__ = [
    "PRESETS",
    "STRATEGIES",
    "ClusterConfig",
    "FailureCause",
    "FailureModel",
    "FailureTrace",
    "JobConfig",
    "RecoveryCosts",
    "Scenario",
    "SimulationResult",
    "Strategy",
    "StrategyResult",
    "daly_interval",
    "ettr_by_interval",
    "expected_ettr",
    "expected_wall_time",
    "optimal_interval",
    "parse_strategies",
    "preset",
    "sample_failures",
    "simulate",
    "strategy_interval",
    "young_interval",
]
