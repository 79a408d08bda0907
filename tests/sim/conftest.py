"""Helpers shared by the simulator tests."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.sim import (
    ClusterConfig,
    FailureCause,
    FailureModel,
    FailureTrace,
    JobConfig,
    RecoveryCosts,
    Scenario,
)


def daly_scenario(mtbf_s: float, delta_s: float, restart_s: float, horizon_s: float) -> Scenario:
    """One GPU, exponential failures cured by a restart, fixed costs: Daly's setting."""
    cause = FailureCause("failure", 3600.0 / mtbf_s, "gpu-hour", "gpu", replace=False)
    return Scenario(
        name="daly",
        cluster=ClusterConfig(nodes=1, gpus_per_node=1),
        failures=FailureModel((cause,)),
        job=JobConfig(sync_save_s=delta_s),
        costs=RecoveryCosts(detect_crash_s=0.0, restart_s=restart_s, restore_remote_s=0.0),
        horizon_s=horizon_s,
    )


def hand_trace(
    times: list[list[float]],
    horizon_s: float,
    *,
    replace: bool = False,
    nodes_lost: int = 1,
    spare_ok: bool = True,
    repair_s: float = 1000.0,
) -> FailureTrace:
    """A trace with the given failure times per replica (padded with inf)."""
    width = max(len(t) for t in times)
    arr = np.full((len(times), width), np.inf)
    for i, row in enumerate(times):
        arr[i, : len(row)] = row
    finite = np.isfinite(arr)
    return FailureTrace(
        horizon_s=horizon_s,
        times=arr,
        cause=np.zeros(arr.shape, dtype=np.int64),
        nodes_lost=np.full(arr.shape, nodes_lost, dtype=np.int64),
        replace=finite & replace,
        hang=np.zeros(arr.shape, dtype=bool),
        repair_s=np.full(arr.shape, repair_s),
        spare_ok=np.full(arr.shape, spare_ok),
        uniform=np.full(arr.shape, 0.5),
        count=finite.sum(axis=1).astype(np.int64),
    )


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
