"""The node agent of `stalwart run`: launcher, zygote, worker supervision, detection."""

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
