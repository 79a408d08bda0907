"""What each recovery strategy does to the job on each sampled failure (vectorised, no loops).

For every failure of every replica a strategy yields: the *pause* (seconds the whole job makes no
progress: detection + recovery; this is the job's RTO), whether it rolls back to the last
*durable* checkpoint or to the last in-memory snapshot, and a *deficit* (capacity-seconds lost
while the job runs on without part of the cluster: elastic and async only).

| strategy | pause (job RTO)                              | rollback       | deficit           |
|----------|----------------------------------------------|----------------|-------------------|
| restart  | detect + [node wait] + restart + load remote | durable        | -                 |
| flash    | detect + [node wait] + flash restart + tier  | memory (1 node)| -                 |
| spare    | detect + takeover (else wait) + tier         | memory (1 node)| -                 |
| elastic  | detect + reconfigure + tier                  | memory (1 node)| share x outage    |
| async    | none (other replicas keep training)          | -              | group x recovery  |

"Node wait" is ``node_replace_s`` when a hot spare node is free, else the node's repair time.
The memory tier (own shared memory, or a peer's replica when the node is gone) survives a fault
that takes one node; a switch fault that takes several nodes may take a node and its peer, so it
rolls back to the durable checkpoint (a stated assumption). Faults cured by a process restart
(``replace=False``) need no node wait; under elastic and async they restart in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from stalwart.errors import ConfigError
from stalwart.sim.failures import ClusterConfig, FailureTrace
from stalwart.sim.job import JobConfig, RecoveryCosts

__all__ = [
    "QUALITY_NOTES",
    "STRATEGIES",
    "TRAITS",
    "EventCosts",
    "Strategy",
    "Traits",
    "event_costs",
    "parse_strategies",
]

Strategy = Literal["restart", "flash", "spare", "elastic", "async"]
STRATEGIES: tuple[Strategy, ...] = ("restart", "flash", "spare", "elastic", "async")

QUALITY_NOTES: dict[Strategy, str] = {
    "restart": "bit-identical to a run without failures",
    "flash": "bit-identical to a run without failures",
    "spare": "bit-identical to a run without failures",
    "elastic": "same loss curve within float tolerance (constant global batch)",
    "async": "convergence penalty applied (LocalSGD/DiLoCo; set from a measured loss gap)",
}


@dataclass(frozen=True)
class Traits:
    """What the simulator asks of a strategy besides its per-failure costs
    (:func:`event_costs`): looked up here, never by comparing its name."""

    durable_rollback: bool
    """A recovery rolls back to the last durable checkpoint (restart), so a checkpoint is
    a synchronous save (its stall is ``sync_save_s``) and every checkpoint persists."""
    pauses_job: bool
    """A failure pauses the whole job; under async only the failed replica group stops,
    so no checkpoint interval is optimal for the job."""
    takes_over: bool
    """A standby takes over every failed rank (spare), even one a process restart would
    cure in place; its restore reads the failed node's memory."""


TRAITS: dict[Strategy, Traits] = {
    "restart": Traits(durable_rollback=True, pauses_job=True, takes_over=False),
    "flash": Traits(durable_rollback=False, pauses_job=True, takes_over=False),
    "spare": Traits(durable_rollback=False, pauses_job=True, takes_over=True),
    "elastic": Traits(durable_rollback=False, pauses_job=True, takes_over=False),
    "async": Traits(durable_rollback=False, pauses_job=False, takes_over=False),
}


def parse_strategies(text: str) -> tuple[Strategy, ...]:
    """Parse ``"restart,flash"`` (or ``"all"``) into strategy names, rejecting unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return STRATEGIES
    if not names:
        raise ConfigError(
            f"no strategy given; use a comma-separated list of {', '.join(STRATEGIES)}"
        )
    out: list[Strategy] = []
    for name in names:
        match = [s for s in STRATEGIES if s == name]
        if not match:
            raise ConfigError(
                f"unknown strategy {name!r}; use a comma-separated list of {', '.join(STRATEGIES)}"
            )
        if match[0] not in out:
            out.append(match[0])
    return tuple(out)


@dataclass(frozen=True)
class EventCosts:
    """Per-failure effect of one strategy; arrays shaped like the trace's ``times``."""

    strategy: Strategy
    pause: NDArray[np.float64]
    durable: NDArray[np.bool_]
    deficit: NDArray[np.float64]
    window: NDArray[np.float64]
    stall_s: float
    persist_s: float
    persist_every: int
    uses_engine: bool
    lost: NDArray[np.float64] | None = None


def _node_wait(trace: FailureTrace, costs: RecoveryCosts) -> NDArray[np.float64]:
    wait = np.where(trace.spare_ok, costs.node_replace_s, trace.repair_s)
    return np.where(trace.replace, wait, 0.0)


@dataclass(frozen=True)
class _Failures:
    """What every strategy's costs start from: the trace and the parts of its pause that
    do not depend on the strategy."""

    trace: FailureTrace
    cluster: ClusterConfig
    job: JobConfig
    costs: RecoveryCosts
    detect: NDArray[np.float64]  # detection latency of each failure
    single: NDArray[np.bool_]  # the failure took at most one node (the memory tier holds)
    tier: NDArray[np.float64]  # the restore from the tier that survives it


def event_costs(
    strategy: Strategy,
    trace: FailureTrace,
    cluster: ClusterConfig,
    job: JobConfig,
    costs: RecoveryCosts,
) -> EventCosts:
    """Pause, rollback target and capacity deficit of every failure in ``trace``."""
    detect = np.where(trace.hang, costs.detect_hang_s, costs.detect_crash_s)
    if trace.lease is not None:
        detect = np.where(trace.lease, costs.detect_lease_s, detect)
    detect = detect + costs.control_plane_s  # then every survivor agrees (the control plane)
    single = trace.nodes_lost <= 1
    tier = np.where(
        ~trace.replace,
        costs.restore_memory_s,
        np.where(single, costs.restore_peer_s, costs.restore_remote_s),
    )
    return _COSTS[strategy](strategy, _Failures(trace, cluster, job, costs, detect, single, tier))


def _in_place(strategy: Strategy, f: _Failures, pause: NDArray[np.float64]) -> EventCosts:
    """A strategy that pauses the whole job and rolls back to memory (one node lost)."""
    zeros = np.zeros(f.trace.times.shape)
    job = f.job
    return EventCosts(
        strategy,
        pause,
        ~f.single,
        zeros,
        pause,
        job.snapshot_stall_s,
        job.persist_s,
        job.persist_every,
        True,
    )


def _restart(strategy: Strategy, f: _Failures) -> EventCosts:
    trace, costs = f.trace, f.costs
    pause = f.detect + _node_wait(trace, costs) + costs.restart_s + costs.restore_remote_s
    zeros = np.zeros(trace.times.shape)
    return EventCosts(
        strategy, pause, np.ones(pause.shape, bool), zeros, pause, f.job.sync_save_s, 0.0, 1, True
    )


def _flash(strategy: Strategy, f: _Failures) -> EventCosts:
    pause = f.detect + _node_wait(f.trace, f.costs) + f.costs.flash_restart_s + f.tier
    return _in_place(strategy, f, pause)


def _spare(strategy: Strategy, f: _Failures) -> EventCosts:
    trace, costs = f.trace, f.costs
    takeover = np.where(
        trace.spare_ok,
        costs.spare_takeover_s,
        trace.repair_s + costs.flash_restart_s,
    )
    pause = f.detect + np.where(trace.replace, takeover, costs.flash_restart_s) + f.tier
    return _in_place(strategy, f, pause)


def _elastic(strategy: Strategy, f: _Failures) -> EventCosts:
    trace, costs = f.trace, f.costs
    share = np.minimum(trace.nodes_lost / f.cluster.nodes, 1.0)
    shrink = f.detect + costs.reconfigure_s + f.tier
    pause = np.where(trace.replace, shrink, f.detect + costs.flash_restart_s + f.tier)
    outage = np.where(trace.replace, _node_wait(trace, costs), 0.0)
    outage = np.minimum(outage, np.maximum(trace.horizon_s - trace.times - pause, 0.0))
    regrow = np.where(trace.replace & (outage > 0), costs.reconfigure_s, 0.0)
    deficit = share * outage + regrow
    window = pause + outage + regrow
    job = f.job
    return EventCosts(
        strategy,
        pause,
        ~f.single,
        deficit,
        window,
        job.snapshot_stall_s,
        job.persist_s,
        job.persist_every,
        True,
    )


def _async(strategy: Strategy, f: _Failures) -> EventCosts:
    """Only the replica group(s) holding the failed nodes stop."""
    trace, costs, job = f.trace, f.costs, f.job
    zeros = np.zeros(trace.times.shape)
    g = min(job.async_group_nodes, f.cluster.nodes)
    groups = np.ceil(trace.nodes_lost / g)
    group_share = np.minimum(groups * g / f.cluster.nodes, 1.0)
    recovery = (
        f.detect
        + _node_wait(trace, costs)
        + costs.flash_restart_s
        + costs.restore_peer_s
        + trace.uniform * job.async_sync_interval_s
    )
    recovery = np.minimum(recovery, np.maximum(trace.horizon_s - trace.times, 0.0))
    recovery = np.where(np.isfinite(trace.times), recovery, 0.0)
    lost = group_share * trace.uniform * job.async_sync_interval_s
    return EventCosts(
        strategy,
        zeros,
        np.zeros(zeros.shape, bool),
        group_share * recovery,
        recovery,
        0.0,
        job.persist_s,
        job.persist_every,
        False,
        lost=np.where(np.isfinite(trace.times), lost, 0.0),
    )


_COSTS: dict[Strategy, Callable[[Strategy, _Failures], EventCosts]] = {
    "restart": _restart,
    "flash": _flash,
    "spare": _spare,
    "elastic": _elastic,
    "async": _async,
}
"""Each strategy's costs: the one place the simulator maps a strategy to what it does."""
