"""The slot files of a job's /dev/shm names, and the checks that keep them the job's own.

The names themselves (rank slots, replicas, the progress board, journals) are the
agent-worker contract's: :class:`~stalwart.contract.shm_names.SlotNames`. This module
is the checkpoint side of them: the slot files (checkpoint/_shm.py), the run's owner
record and the startup sweep of stale runs (checkpoint/_stale.py), the replica marker.
Directories are created 0700 and an existing one is accepted only if it is a real
directory owned by this user (:func:`ensure_private_dir`); every file in them is opened
``O_NOFOLLOW`` (docs/security.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

from stalwart.checkpoint._shm import (
    SLOT_FORMAT,
    SLOT_VERSION,
    SlotFiles,
    SlotMeta,
    Window,
    ensure_private_dir,
    latest_complete,
    open_private,
    pin_slot,
    pinned_slots,
    slot_count,
    unpin_slot,
)
from stalwart.checkpoint._stale import OwnerRecord, sweep_stale
from stalwart.contract.shm_names import REPLICA_MARKER, SlotNames

__all__ = [
    "SLOT_FORMAT",
    "SLOT_VERSION",
    "OwnerRecord",
    "SlotFiles",
    "SlotMeta",
    "Window",
    "ensure_private_dir",
    "latest_complete",
    "open_private",
    "pin_slot",
    "pinned_slots",
    "read_replica_marker",
    "run_owner",
    "slot_count",
    "sweep_stale",
    "unpin_slot",
    "write_replica_marker",
]


def run_owner(names: SlotNames) -> OwnerRecord:
    """This process's owner record of the run ``names`` (checkpoint/_stale.py): what
    tells a later agent's startup sweep that the run's names are still in use."""
    return OwnerRecord(names.shm_dir, names.stem)


# -- the replica marker ---------------------------------------------------------------


def write_replica_marker(directory: str, doc: dict[str, Any]) -> None:
    """Mark ``directory`` (a rank's slots) as taken over from a replica."""
    with open_private(os.path.join(directory, REPLICA_MARKER), "w") as f:
        json.dump(doc, f)


def read_replica_marker(directory: str, *, consume: bool) -> bool:
    """Whether ``directory`` holds slots taken over from a replica; ``consume``: remove
    the marker (true once)."""
    path = os.path.join(directory, REPLICA_MARKER)
    if not consume:
        return os.path.exists(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
