"""The worker runtime: ``stalwart.init()``, :class:`Session`, the per-generation group.

Importing this package imports no torch (PEP 562). The worker contract it reads
(:class:`~stalwart.contract.env.WorkerEnv`) lives in :mod:`stalwart.contract`.

Its parts, by role (each sub-package's docstring lists its modules; docs/architecture.md
draws them): ``session.py`` (``stalwart.init()``, :class:`Session`: the step loop that
drives the others), ``backend.py`` (the seam to the c10d backend), ``comm/`` (the
coordinator's store and the process groups that follow the generations), ``rejoin/``
(joining a generation: the Formation every rejoin returns, the fixed-size rejoin),
``elastic/`` and ``replica_groups/`` (the rejoins of ``--strategy elastic`` and
``async``), ``integrity/`` (replica digests, numerical faults), ``state/`` (the tracked
state and its checkpoints, memory tier, per-rank part), ``steps/`` (step timing, the
snapshot and persist cadence, the progress board line, metrics, step-keyed chaos).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.runtime.comm.group import GenerationGroup, ensure_local_default_group
    from stalwart.runtime.session import Session, init

__all__ = ["GenerationGroup", "Session", "ensure_local_default_group", "init"]


def __getattr__(name: str) -> Any:
    if name in ("GenerationGroup", "ensure_local_default_group"):
        from stalwart.runtime.comm import group

        return getattr(group, name)
    if name in ("Session", "init"):
        from stalwart.runtime import session

        return getattr(session, name)
    raise AttributeError(f"module 'stalwart.runtime' has no attribute {name!r}")
