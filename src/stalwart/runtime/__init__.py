"""The worker runtime: ``stalwart.init()``, :class:`Session`, the per-generation group."""

from __future__ import annotations

from stalwart.runtime.env import WorkerEnv
from stalwart.runtime.group import GenerationGroup, ensure_local_default_group
from stalwart.runtime.session import Session, init

__all__ = ["GenerationGroup", "Session", "WorkerEnv", "ensure_local_default_group", "init"]
