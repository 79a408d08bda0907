"""What the agent's detectors report: one frozen record per incident, named by its domain.

A detector decides and reports; it does not recover. The agent isolates (kills a hung
rank, blocklists a lost node) and hands the incidents that need a recovery to the job's
:class:`~stalwart.agent.strategies.policy.RecoveryPolicy`. A new detector (stragglers, health
probes, silent data corruption) adds a record here and a branch in the policies that
act on it; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.agent.detection.verdict import Failure

__all__ = [
    "COLLATERAL",
    "Incident",
    "NodeLost",
    "ProbeFailed",
    "Straggler",
    "WorkerExited",
    "WorkerHung",
]

COLLATERAL = "collateral"
"""The cause of a survivor the agent killed because another fault left it behind (it
waits in a collective of a generation the job left): recovered, never counted."""


@dataclass(frozen=True)
class WorkerExited:
    """A worker process failed (crashed, or was killed by the agent for a hang)."""

    rank: int
    pid: int
    rc: int
    cause: str  # crash | hang | collateral | straggler
    failure: Failure  # where it failed, its error (agent/detection/verdict.py)
    verdict: str | None  # the crash-loop verdict: it would fail the same way again
    collateral: bool = False
    """The agent killed it as collateral of another rank's fault (it waited in a
    collective of a generation the job left): recovered like a failure, but not counted
    as one of this rank's or node's (crash-loop verdict, isolation)."""


@dataclass(frozen=True)
class WorkerHung:
    """A worker makes no progress (agent/detection/hang.py): the agent kills it, and its exit
    comes back as :class:`WorkerExited` with cause ``hang``."""

    rank: int
    pid: int
    how: str
    stalled_s: float
    threshold_s: float
    latency_s: float  # from the injected fault, else the stall itself
    collateral: bool = False  # waits on a generation another fault ended (detect.py)


@dataclass(frozen=True)
class NodeLost:
    """A node's agent lease expired without a goodbye (or it cordoned itself); this
    node adopts its ``ranks``."""

    node: int
    ranks: tuple[int, ...]
    how: str
    latency_s: float
    cordoned: bool  # it said so itself (repeated failures): nothing to report


@dataclass(frozen=True)
class ProbeFailed:
    """A health probe of this node started failing (agent/health/probes.py): the agent
    isolates the node (``--on-probe isolate``) before the fault takes the job down, or
    only reports it (``report``)."""

    node: int
    probe: str  # host | shm | disk | disk_write | nvml
    device: int | None  # the GPU (nvml), else None: the node
    detail: str  # the reading, the problem and the fix


@dataclass(frozen=True)
class Straggler:
    """A rank computes persistently slower than the job's others (agent/detection/stragglers.py).
    Under ``--on-straggler evict`` the agent ends its process, whose exit comes back as
    :class:`WorkerExited` with cause ``straggler`` and is recovered by the strategy's
    means; under ``report`` it keeps running."""

    rank: int
    pid: int
    node: int  # the fault domain: this rank on this node
    compute_s: float  # its mean compute time per step in the last window
    median_s: float  # the other ranks' median
    ratio: float  # compute_s / median_s
    score: float  # robust z-score against the others
    windows: int  # the windows that declared it (in a row, or of the last ``of_last``)
    latency_s: float  # from the injected slowdown, else from the first flagged window
    evict: bool  # the policy: replace it (True) or only report it


Incident = WorkerExited | NodeLost
"""What a recovery policy acts on."""
