"""The node agent of `stalwart run`: launcher, zygote, worker supervision, detection.

agent.py wires one part of each role and runs the loop; config.py is the node's flags.
The roles, one sub-package each (docs/architecture.md draws them): processes/ (the
worker processes and the zygote), detection/ (typed incidents), strategies/ (one
recovery policy per ``--strategy``), health/ (the node's probes, preflight, /healthz),
cluster/ (the store, membership, leases, the generation) and rundir/ (the run directory).
"""

from __future__ import annotations

from stalwart.agent.agent import Agent, run_agent
from stalwart.agent.config import STRATEGIES, LaunchConfig, ZygoteStart
from stalwart.agent.detection.dataplane import Cut, Stall, decide, find_stall
from stalwart.agent.detection.hang import Activity, CpuTracker, HangConfig, HangVerdict, find_hang

__all__ = [
    "STRATEGIES",
    "Activity",
    "Agent",
    "CpuTracker",
    "Cut",
    "HangConfig",
    "HangVerdict",
    "LaunchConfig",
    "Stall",
    "ZygoteStart",
    "decide",
    "find_hang",
    "find_stall",
    "run_agent",
]
