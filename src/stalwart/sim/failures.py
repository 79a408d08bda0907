"""Failure processes of a cluster, and their vectorised sampling over Monte Carlo replicas.

Model
-----
A :class:`FailureModel` is a list of :class:`FailureCause`. Each cause has a rate, per GPU-hour
(hardware that scales with GPUs) or per node-day (how Meta reports cluster-level rates), a fault
domain (``gpu`` and ``node`` take one node out of the job, ``switch`` takes
``ClusterConfig.nodes_per_switch`` nodes), whether a process restart cures it (``replace=False``)
or the node must leave the job until it is repaired (``replace=True``), and how it shows itself
(``crash``: a process exits or a socket closes; ``hang``: only a watchdog notices; ``lease``: a
whole node vanishes and only the expiry of its lease tells).

Trade-offs
----------
* Cost grows with the number of failures, never with the number of GPUs: a cause's per-GPU rate
  is multiplied by the job's GPUs and sampled as one *job-level* process. For exponential
  inter-arrival times this is exact (a superposition of Poisson processes is Poisson).
* Weibull inter-arrival times are applied to each cause's job-level renewal process, not to each
  GPU: by the Palm-Khintchine theorem a superposition of thousands of independent per-GPU renewal
  processes is close to Poisson, so a per-GPU Weibull would be indistinguishable from exponential
  at scale. A job-level Weibull with shape < 1 instead models what traces show (failures cluster
  in time; Schroeder & Gibson, "A large-scale study of failures in high-performance computing
  systems", DSN 2006, fit shapes 0.7-0.8). The mean rate is kept, only burstiness changes.
* Each process starts fresh at t = 0 (the job starts on a freshly checked cluster).
* Repairs: a node that must be replaced is away for a repair time (fixed or exponential around
  ``ClusterConfig.repair_s``); a hot spare is available when fewer than ``spare_nodes`` nodes are
  in repair (the spare pool is the set of healthy nodes outside the job, so no sequential
  bookkeeping is needed). Without a spare the job waits for its own node's repair (an upper bound:
  another node may come back sooner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from stalwart.errors import ConfigError

__all__ = [
    "ClusterConfig",
    "Distribution",
    "FailureCause",
    "FailureModel",
    "FailureTrace",
    "FaultDomain",
    "FaultKind",
    "RateUnit",
    "RepairDistribution",
    "sample_failures",
]

FaultDomain = Literal["gpu", "node", "switch"]
FaultKind = Literal["crash", "hang", "lease"]
RateUnit = Literal["gpu-hour", "node-day"]
Distribution = Literal["exponential", "weibull"]
RepairDistribution = Literal["fixed", "exponential"]

_DOMAINS = ("gpu", "node", "switch")
_KINDS = ("crash", "hang", "lease")
_UNITS = ("gpu-hour", "node-day")


def _check_finite(name: str, value: float, *, positive: bool, fix: str) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name} must be a finite number {want}, got {value!r}; {fix}")


@dataclass(frozen=True)
class ClusterConfig:
    """The machines the job runs on.

    ``nodes`` x ``gpus_per_node`` GPUs run the job; ``spare_nodes`` healthy nodes wait outside it;
    a switch fault takes ``nodes_per_switch`` nodes; a replaced node comes back after ``repair_s``.
    """

    nodes: int
    gpus_per_node: int = 8
    spare_nodes: int = 0
    nodes_per_switch: int = 16
    repair_s: float = 3 * 86400.0
    repair_distribution: RepairDistribution = "exponential"

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(
                f"the cluster needs at least 1 node, got {self.nodes}; pass --gpus >= 1"
            )
        if self.gpus_per_node < 1:
            raise ConfigError(
                f"gpus per node must be >= 1, got {self.gpus_per_node}; pass --gpus-per-node >= 1"
            )
        if self.spare_nodes < 0:
            raise ConfigError(
                f"spare nodes must be >= 0, got {self.spare_nodes}; pass --spares >= 0"
            )
        if self.nodes_per_switch < 1:
            raise ConfigError(f"nodes per switch must be >= 1, got {self.nodes_per_switch}")
        _check_finite("repair time", self.repair_s, positive=True, fix="pass --repair-hours > 0")
        if self.repair_distribution not in ("fixed", "exponential"):
            raise ConfigError(
                f"unknown repair distribution {self.repair_distribution!r}; "
                "use fixed or exponential"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class FailureCause:
    """One cause of job interruptions, with its rate and what it does to the job."""

    name: str
    rate: float
    unit: RateUnit = "gpu-hour"
    domain: FaultDomain = "gpu"
    replace: bool = True
    kind: FaultKind = "crash"

    def __post_init__(self) -> None:
        _check_finite(
            f"rate of failure cause {self.name!r}",
            self.rate,
            positive=False,
            fix="failure rates cannot be negative",
        )
        if self.unit not in _UNITS:
            raise ConfigError(f"unknown rate unit {self.unit!r} for {self.name!r}; use {_UNITS}")
        if self.domain not in _DOMAINS:
            raise ConfigError(
                f"unknown fault domain {self.domain!r} for {self.name!r}; use {_DOMAINS}"
            )
        if self.kind not in _KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r} for {self.name!r}; use {_KINDS}")

    def rate_per_s(self, cluster: ClusterConfig) -> float:
        """Job-level rate (failures per second of wall time) on ``cluster``."""
        if self.unit == "gpu-hour":
            return self.rate * cluster.gpus / 3600.0
        return self.rate * cluster.nodes / 86400.0


@dataclass(frozen=True)
class FailureModel:
    """Causes plus the inter-arrival law shared by all of them."""

    causes: tuple[FailureCause, ...]
    distribution: Distribution = "exponential"
    weibull_shape: float = 0.7

    def __post_init__(self) -> None:
        if not self.causes:
            raise ConfigError("the failure model has no causes; give a preset or a failure rate")
        if self.distribution not in ("exponential", "weibull"):
            raise ConfigError(
                f"unknown failure distribution {self.distribution!r}; use exponential or weibull"
            )
        _check_finite(
            "Weibull shape", self.weibull_shape, positive=True, fix="pass --weibull-shape > 0"
        )

    def rate_per_s(self, cluster: ClusterConfig) -> float:
        return sum(c.rate_per_s(cluster) for c in self.causes)

    def mtbf_s(self, cluster: ClusterConfig) -> float:
        """Mean time between job interruptions on ``cluster`` (inf when no cause fires)."""
        rate = self.rate_per_s(cluster)
        return math.inf if rate == 0 else 1.0 / rate


@dataclass(frozen=True)
class FailureTrace:
    """Sampled failures of ``replicas`` runs, padded to the longest run with ``inf`` times.

    Every array is ``(replicas, max_failures)``; entries past a replica's ``count`` are padding.
    """

    horizon_s: float
    times: NDArray[np.float64]
    cause: NDArray[np.int64]
    nodes_lost: NDArray[np.int64]
    replace: NDArray[np.bool_]
    hang: NDArray[np.bool_]
    repair_s: NDArray[np.float64]
    spare_ok: NDArray[np.bool_]
    uniform: NDArray[np.float64]
    count: NDArray[np.int64]
    lease: NDArray[np.bool_] | None = None  # detected by lease expiry (None: no such failure)

    @property
    def replicas(self) -> int:
        return int(self.times.shape[0])

    @property
    def events(self) -> int:
        return int(self.count.sum())


def _exponential_times(
    rate: float, horizon: float, replicas: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    counts = rng.poisson(rate * horizon, size=replicas)
    width = int(counts.max()) if replicas else 0
    times = rng.random((replicas, width)) * horizon
    times[np.arange(width)[None, :] >= counts[:, None]] = np.inf
    times.sort(axis=1)
    return times


def _weibull_times(
    rate: float, shape: float, horizon: float, replicas: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    scale = 1.0 / rate / math.gamma(1.0 + 1.0 / shape)
    expected = rate * horizon
    batch = math.ceil(expected + 5.0 * math.sqrt(expected) + 5.0)
    gaps = scale * rng.weibull(shape, size=(replicas, batch))
    cum = np.cumsum(gaps, axis=1)
    while replicas and float(cum[:, -1].min()) < horizon:
        more = np.cumsum(scale * rng.weibull(shape, size=(replicas, batch)), axis=1)
        cum = np.concatenate([cum, cum[:, -1:] + more], axis=1)
    cum[cum >= horizon] = np.inf
    return cum


def _spares_available(
    times: NDArray[np.float64],
    nodes: NDArray[np.int64],
    replace: NDArray[np.bool_],
    repair: NDArray[np.float64],
    spares: int,
) -> NDArray[np.bool_]:
    """True where the nodes in repair at each failure (itself included) fit in the spare pool."""
    replicas, width = times.shape
    if width == 0:
        return np.zeros((replicas, 0), dtype=bool)
    weight = np.where(replace & np.isfinite(times), nodes, 0)
    returns = np.where(weight > 0, times + repair, np.inf)
    finite = np.concatenate([times[np.isfinite(times)], returns[np.isfinite(returns)], [1.0]])
    base = float(finite.max()) + 1.0
    span = 2.0 * base
    order = np.argsort(returns, axis=1)
    ret_sorted = np.take_along_axis(returns, order, axis=1)
    returned_cum = np.cumsum(np.take_along_axis(weight, order, axis=1), axis=1)
    rows = np.arange(replicas)[:, None] * span
    keys = (np.minimum(ret_sorted, base) + rows).ravel()
    probes = (np.minimum(times, base - 0.5) + rows).ravel()
    idx = np.searchsorted(keys, probes, side="right").reshape(replicas, width)
    idx -= np.arange(replicas)[:, None] * width
    padded = np.concatenate([np.zeros((replicas, 1), dtype=returned_cum.dtype), returned_cum], 1)
    returned = np.take_along_axis(padded, idx, axis=1)
    in_repair = np.cumsum(weight, axis=1) - returned
    return np.asarray(in_repair <= spares)


def sample_failures(
    cluster: ClusterConfig,
    model: FailureModel,
    horizon_s: float,
    replicas: int,
    rng: np.random.Generator,
) -> FailureTrace:
    """Sample the failures of ``replicas`` independent runs of ``horizon_s`` seconds."""
    _check_finite("horizon", horizon_s, positive=True, fix="pass --days > 0")
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}; pass --replicas >= 1")
    rates = np.array([c.rate_per_s(cluster) for c in model.causes])
    total = float(rates.sum())
    if total == 0:
        times = np.zeros((replicas, 0))
        cause = np.zeros((replicas, 0), dtype=np.int64)
    elif model.distribution == "exponential":
        times = _exponential_times(total, horizon_s, replicas, rng)
        cause = rng.choice(len(rates), size=times.shape, p=rates / total).astype(np.int64)
    else:
        parts = [
            (_weibull_times(float(r), model.weibull_shape, horizon_s, replicas, rng), i)
            for i, r in enumerate(rates)
            if r > 0
        ]
        all_times = np.concatenate([p for p, _ in parts], axis=1)
        all_cause = np.concatenate([np.full(p.shape, i, dtype=np.int64) for p, i in parts], 1)
        order = np.argsort(all_times, axis=1)
        width = int(np.isfinite(all_times).sum(axis=1).max())
        times = np.take_along_axis(all_times, order, axis=1)[:, :width]
        cause = np.take_along_axis(all_cause, order, axis=1)[:, :width]
    finite = np.isfinite(times)
    domain_nodes = np.array(
        [cluster.nodes_per_switch if c.domain == "switch" else 1 for c in model.causes]
    )
    nodes_lost = np.minimum(domain_nodes[cause], cluster.nodes).astype(np.int64)
    replace = np.array([c.replace for c in model.causes], dtype=bool)[cause] & finite
    hang = np.array([c.kind == "hang" for c in model.causes], dtype=bool)[cause] & finite
    lease = np.array([c.kind == "lease" for c in model.causes], dtype=bool)[cause] & finite
    if cluster.repair_distribution == "fixed":
        repair = np.full(times.shape, cluster.repair_s)
    else:
        repair = rng.exponential(cluster.repair_s, size=times.shape)
    spare_ok = _spares_available(times, nodes_lost, replace, repair, cluster.spare_nodes)
    return FailureTrace(
        horizon_s=horizon_s,
        times=times,
        cause=cause,
        nodes_lost=nodes_lost,
        replace=replace,
        hang=hang,
        repair_s=repair,
        spare_ok=spare_ok,
        uniform=rng.random(times.shape),
        count=finite.sum(axis=1).astype(np.int64),
        lease=lease if lease.any() else None,
    )
