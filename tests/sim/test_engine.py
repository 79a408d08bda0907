"""The engine on hand-made traces whose outcome is computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.errors import ConfigError
from stalwart.sim import (
    ClusterConfig,
    FailureCause,
    FailureModel,
    JobConfig,
    RecoveryCosts,
    Scenario,
    ettr_by_interval,
    simulate,
)

from .conftest import daly_scenario, hand_trace


def _one(sc: Scenario, times: list[float], strategy: str = "restart", **kw: object) -> float:
    trace = hand_trace([times], sc.horizon_s, **kw)  # type: ignore[arg-type]
    return float(ettr_by_interval(sc, strategy, trace, np.array([100.0]))[0, 0])  # type: ignore[arg-type]


def test_no_failure_costs_only_the_checkpoint_stall() -> None:
    sc = daly_scenario(3600.0, 10.0, 50.0, horizon_s=1100.0)
    # 10 cycles of 100 s compute + 10 s save: 1000 s kept of 1100 s.
    assert _one(sc, []) == pytest.approx(1000.0 / 1100.0)


def test_failure_rolls_back_to_last_checkpoint_and_pauses() -> None:
    sc = daly_scenario(3600.0, 10.0, 50.0, horizon_s=1000.0)
    # Failure at 250 s: two checkpoints done (work 200), 30 s of work lost; resume at 300 s.
    # 700 s left: 6 cycles (600 work) + 40 s of compute -> 200 + 640 = 840.
    assert _one(sc, [250.0]) == pytest.approx(840.0 / 1000.0)


def test_failure_during_checkpoint_loses_the_whole_interval() -> None:
    sc = daly_scenario(3600.0, 10.0, 50.0, horizon_s=1000.0)
    # Failure at 215 s is inside the second save (210-220): checkpoint at work 100 only.
    # Resume at 265 s, 735 s left: 6 cycles + 75 s -> 100 + 675 = 775.
    assert _one(sc, [215.0]) == pytest.approx(775.0 / 1000.0)


def test_failure_during_recovery_restarts_the_recovery() -> None:
    sc = daly_scenario(3600.0, 10.0, 50.0, horizon_s=1000.0)
    # Failures at 250 s and 280 s (inside the 50 s pause): resume at 330 s with work 200.
    # 670 s left: 6 cycles + 10 s -> 200 + 610 = 810.
    assert _one(sc, [250.0, 280.0]) == pytest.approx(810.0 / 1000.0)


def _cluster_scenario(**job: object) -> Scenario:
    cause = FailureCause("f", 1e-6, "gpu-hour", "gpu", replace=True)
    return Scenario(
        name="x",
        cluster=ClusterConfig(nodes=4, gpus_per_node=1, spare_nodes=1),
        failures=FailureModel((cause,)),
        job=JobConfig(snapshot_stall_s=10.0, sync_save_s=10.0, persist_s=0.0, **job),  # type: ignore[arg-type]
        costs=RecoveryCosts(
            detect_crash_s=0.0,
            restart_s=50.0,
            restore_remote_s=0.0,
            flash_restart_s=20.0,
            restore_peer_s=0.0,
            node_replace_s=100.0,
            spare_takeover_s=5.0,
            reconfigure_s=5.0,
        ),
        horizon_s=1000.0,
    )


def test_strategies_on_a_node_loss_rank_by_their_pause() -> None:
    sc = _cluster_scenario()
    got = {s: _one(sc, [250.0], s, replace=True) for s in ("restart", "flash", "spare")}
    # Pauses: restart 100 + 50, flash 100 + 20, spare 5. Restart resumes at 400 s with work 200;
    # 600 s left: 5 cycles + 50 s -> 750.
    assert got["restart"] == pytest.approx(0.75)
    assert got["restart"] < got["flash"] < got["spare"]


def test_without_a_spare_the_job_waits_for_the_repair() -> None:
    sc = _cluster_scenario()
    fast = _one(sc, [250.0], "flash", replace=True, spare_ok=True, repair_s=400.0)
    slow = _one(sc, [250.0], "flash", replace=True, spare_ok=False, repair_s=400.0)
    # Waiting 400 s instead of 100 s costs 300 s of the 110 s cycle: ~273 s of work.
    assert fast - slow == pytest.approx(300.0 * 100.0 / 110.0 / 1000.0, abs=0.011)


def test_elastic_loses_only_the_missing_share_while_the_node_is_away() -> None:
    sc = _cluster_scenario()
    elastic = _one(sc, [250.0], "elastic", replace=True, spare_ok=False, repair_s=400.0)
    # Pause 5 s, then 3 of 4 nodes for 400 s (deficit 100 s) plus a 5 s regrow; cycles are
    # 100 / 110 compute. Kept work: 200 + (745 s -> 6 cycles + 85) - (100 + 5) * 100/110.
    kept = 200.0 + 6 * 100.0 + 85.0 - 105.0 * 100.0 / 110.0
    assert elastic == pytest.approx(kept / 1000.0)


def test_async_penalty_is_applied_even_without_failures() -> None:
    sc = _cluster_scenario(async_penalty=0.1)
    assert _one(sc, [], "async") == pytest.approx(0.9)


def test_simulate_summarises_every_strategy_on_the_same_failures() -> None:
    sc = daly_scenario(3600.0, 60.0, 300.0, horizon_s=30 * 86400.0)
    result = simulate(sc, ("restart", "flash", "spare", "elastic", "async"), replicas=20)
    assert [r.strategy for r in result.results] == ["restart", "flash", "spare", "elastic", "async"]
    assert len({r.failures for r in result.results}) == 1
    assert all(0 < r.ettr <= 1 and r.ettr_ci95 >= 0 for r in result.results)
    assert result.results[0].rto_s == pytest.approx(300.0)
    assert result.results[0].idle_share == pytest.approx(1.0)


def test_bad_intervals_are_rejected() -> None:
    sc = daly_scenario(3600.0, 60.0, 300.0, horizon_s=86400.0)
    trace = hand_trace([[100.0]], sc.horizon_s)
    with pytest.raises(ConfigError, match="intervals"):
        ettr_by_interval(sc, "restart", trace, np.array([0.0]))
