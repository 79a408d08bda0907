"""The node agent of `stalwart run`: launcher, zygote, worker supervision, detection."""

from __future__ import annotations

from stalwart.agent.agent import Agent, run_agent
from stalwart.agent.config import STRATEGIES, LaunchConfig, RuntimeKnobs, ZygoteStart
from stalwart.agent.detect import Activity, CpuTracker, HangConfig, HangVerdict, find_hang
from stalwart.agent.progress import ProgressBoard, Slot

__all__ = [
    "STRATEGIES",
    "Activity",
    "Agent",
    "CpuTracker",
    "HangConfig",
    "HangVerdict",
    "LaunchConfig",
    "ProgressBoard",
    "RuntimeKnobs",
    "Slot",
    "ZygoteStart",
    "find_hang",
    "run_agent",
]
