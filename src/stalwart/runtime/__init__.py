"""The worker runtime: ``stalwart.init()``, :class:`Session`, the per-generation group.

Importing this package imports no torch (PEP 562). The worker contract it reads
(:class:`~stalwart.contract.env.WorkerEnv`) lives in :mod:`stalwart.contract`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.runtime.group import GenerationGroup, ensure_local_default_group
    from stalwart.runtime.session import Session, init

__all__ = ["GenerationGroup", "Session", "ensure_local_default_group", "init"]


def __getattr__(name: str) -> Any:
    if name in ("GenerationGroup", "ensure_local_default_group"):
        from stalwart.runtime import group

        return getattr(group, name)
    if name in ("Session", "init"):
        from stalwart.runtime import session

        return getattr(session, name)
    raise AttributeError(f"module 'stalwart.runtime' has no attribute {name!r}")
