from __future__ import annotations

import numpy as np
import pytest

from stalwart.errors import ConfigError
from stalwart.sim import ClusterConfig, FailureCause, FailureModel, preset, sample_failures


def test_exponential_counts_follow_the_rate(rng: np.random.Generator) -> None:
    cluster = ClusterConfig(nodes=100, gpus_per_node=8)
    model = FailureModel((FailureCause("a", 1e-4, "gpu-hour"),))
    horizon = 10 * 86400.0
    trace = sample_failures(cluster, model, horizon, 400, rng)
    expected = 1e-4 * 800 * 240  # 19.2 per run
    assert trace.count.mean() == pytest.approx(expected, rel=0.05)
    finite = np.isfinite(trace.times)
    assert np.all(trace.times[:, :-1] <= trace.times[:, 1:])
    assert np.all(trace.times[finite] < horizon)
    assert np.array_equal(finite.sum(axis=1), trace.count)


def test_trace_size_follows_failures_not_gpus(rng: np.random.Generator) -> None:
    # 100x the GPUs at 1/100 the rate: same job-level process, same array sizes.
    small = ClusterConfig(nodes=10, gpus_per_node=8)
    large = ClusterConfig(nodes=1000, gpus_per_node=8)
    a = sample_failures(small, FailureModel((FailureCause("a", 1e-3),)), 86400.0 * 30, 50, rng)
    b = sample_failures(large, FailureModel((FailureCause("a", 1e-5),)), 86400.0 * 30, 50, rng)
    assert a.times.shape[1] < 4 * a.count.mean()
    assert b.times.shape[1] < 4 * b.count.mean()
    assert b.count.mean() == pytest.approx(a.count.mean(), rel=0.2)


def test_causes_keep_their_shares(rng: np.random.Generator) -> None:
    sc = preset("llama3-54d")
    trace = sample_failures(sc.cluster, sc.failures, sc.horizon_s, 100, rng)
    finite = np.isfinite(trace.times)
    shares = np.bincount(trace.cause[finite], minlength=len(sc.failures.causes)) / finite.sum()
    assert shares[0] == pytest.approx(148 / 419, abs=0.02)  # faulty GPU
    switch = [i for i, c in enumerate(sc.failures.causes) if c.domain == "switch"]
    assert np.all(trace.nodes_lost[finite & (trace.cause == switch[0])] == 16)


def test_spare_availability_matches_brute_force(rng: np.random.Generator) -> None:
    cluster = ClusterConfig(nodes=64, gpus_per_node=8, spare_nodes=3, repair_s=5 * 86400.0)
    model = FailureModel((FailureCause("a", 2e-5), FailureCause("b", 1e-5, domain="switch")))
    trace = sample_failures(cluster, model, 30 * 86400.0, 20, rng)
    assert trace.events > 100
    for r in range(trace.replicas):
        t, n = trace.times[r], trace.count[r]
        back = t + trace.repair_s[r]
        for k in range(n):
            in_repair = sum(
                int(trace.nodes_lost[r, j])
                for j in range(k + 1)
                if trace.replace[r, j] and back[j] > t[k]
            )
            assert trace.spare_ok[r, k] == (in_repair <= cluster.spare_nodes)
    assert not trace.spare_ok[np.isfinite(trace.times)].all()


def test_no_failures_gives_an_empty_trace(rng: np.random.Generator) -> None:
    cluster = ClusterConfig(nodes=2)
    trace = sample_failures(cluster, FailureModel((FailureCause("a", 0.0),)), 3600.0, 3, rng)
    assert trace.times.shape == (3, 0)
    assert trace.events == 0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FailureCause("x", -1.0), "rate of failure cause 'x'"),
        (lambda: FailureCause("x", 1.0, domain="rack"), "fault domain"),  # type: ignore[arg-type]
        (lambda: ClusterConfig(nodes=0), "at least 1 node"),
        (lambda: ClusterConfig(nodes=2, spare_nodes=-1), "spare"),
        (lambda: FailureModel(()), "no causes"),
        (lambda: FailureModel((FailureCause("x", 1.0),), "gamma"), "distribution"),  # type: ignore[arg-type]
        (lambda: FailureModel((FailureCause("x", 1.0),), "weibull", 0.0), "Weibull shape"),
    ],
)
def test_bad_parameters_name_the_problem(make: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()  # type: ignore[operator]


def test_bad_sampling_arguments(rng: np.random.Generator) -> None:
    model = FailureModel((FailureCause("x", 1.0),))
    with pytest.raises(ConfigError, match="replicas"):
        sample_failures(ClusterConfig(nodes=1), model, 10.0, 0, rng)
    with pytest.raises(ConfigError, match="horizon"):
        sample_failures(ClusterConfig(nodes=1), model, -1.0, 1, rng)
