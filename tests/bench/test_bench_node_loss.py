"""bench/node_loss.py's figures from one repetition's runs, and what makes a repetition
invalid (in process, on run results as run_job returns them)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def node_loss(harness: ModuleType) -> ModuleType:
    import node_loss as mod

    return mod


def _loss(rto: float) -> dict[str, Any]:
    return {"codes": [0, 137], "step_s": 0.1, "rto_s": rto, "detect_s": 0.1, "tiers": ["peer"]}


def test_figures_pair_memory_with_disk_and_on_with_off(node_loss: ModuleType) -> None:
    runs = {
        "steady-off": {"codes": [0, 0], "step_s": 0.100},
        "steady-on": {"codes": [0, 0], "step_s": 0.102},
        "loss-memory": _loss(0.4),
        "loss-disk": _loss(0.8),
    }
    fig = node_loss.repetition_figures(runs)
    assert fig["node_loss_rto_memory_vs_disk"] == pytest.approx(0.5)
    assert fig["replication_overhead_ratio"] == pytest.approx(1.02)
    assert math.isnan(fig["etcd_failover_pause_s"])  # not run: not measured
    assert fig["memory_restore_tiers"] == ["peer"]


def test_a_failed_agent_or_an_unfired_kill_invalidates(node_loss: ModuleType) -> None:
    assert node_loss.check_run("loss-memory", _loss(0.4)) == []
    failed = node_loss.check_run("steady-on", {"codes": [0, 1], "step_s": 0.1})
    assert "exited [0, 1]" in failed[0].reason
    unfired = node_loss.check_run("loss-disk", {"codes": [0, 0], "step_s": 0.1})
    assert "met 0 faults" in unfired[0].reason
