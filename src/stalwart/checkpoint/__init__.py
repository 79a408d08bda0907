"""The checkpoint engine: snapshot -> persist -> commit -> restore.

Import is lazy (PEP 562): the torch-free parts (format, storage, catalog, the persister
process) can be used without importing torch, which is what keeps the persister's start
at tens of milliseconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.checkpoint._lazy import load_state_of, state_dict_of
    from stalwart.checkpoint._state import RNGState
    from stalwart.checkpoint._writer import publish_step
    from stalwart.checkpoint.catalog import VerifyReport, committed_steps, verify_step
    from stalwart.checkpoint.commit import (
        CommitFence,
        CommitOutcome,
        CommitPlan,
        CommitResult,
        CommitStore,
        FencedCommit,
        ShardedCommit,
        StepCommitter,
    )
    from stalwart.checkpoint.manager import CheckpointConfig, CheckpointManager
    from stalwart.checkpoint.persist import PersistConfig, Persister, PersistResult
    from stalwart.checkpoint.restore import RestoreResult, restore_state
    from stalwart.checkpoint.retention import GcReport, RetentionPolicy, collect_garbage
    from stalwart.checkpoint.snapshot import SnapshotConfig, SnapshotResult, Snapshotter
    from stalwart.checkpoint.storage import open_storage

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CommitFence",
    "CommitOutcome",
    "CommitPlan",
    "CommitResult",
    "CommitStore",
    "FencedCommit",
    "GcReport",
    "PersistConfig",
    "PersistResult",
    "Persister",
    "RNGState",
    "RestoreResult",
    "RetentionPolicy",
    "ShardedCommit",
    "SnapshotConfig",
    "SnapshotResult",
    "Snapshotter",
    "StepCommitter",
    "VerifyReport",
    "collect_garbage",
    "committed_steps",
    "load_state_of",
    "open_storage",
    "publish_step",
    "restore_state",
    "state_dict_of",
    "verify_step",
]

_WHERE = {
    "RNGState": "_state",
    "load_state_of": "_lazy",
    "state_dict_of": "_lazy",
    "publish_step": "_writer",
    "VerifyReport": "catalog",
    "committed_steps": "catalog",
    "verify_step": "catalog",
    "CommitFence": "commit",
    "CommitOutcome": "commit",
    "CommitPlan": "commit",
    "CommitResult": "commit",
    "CommitStore": "commit",
    "FencedCommit": "commit",
    "ShardedCommit": "commit",
    "StepCommitter": "commit",
    "CheckpointConfig": "manager",
    "CheckpointManager": "manager",
    "PersistConfig": "persist",
    "Persister": "persist",
    "PersistResult": "persist",
    "RestoreResult": "restore",
    "restore_state": "restore",
    "GcReport": "retention",
    "RetentionPolicy": "retention",
    "collect_garbage": "retention",
    "SnapshotConfig": "snapshot",
    "Snapshotter": "snapshot",
    "SnapshotResult": "snapshot",
    "open_storage": "storage",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"stalwart.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'stalwart.checkpoint' has no attribute {name!r}")
