"""Exception classes shared by every part of stalwart.

Each error names the problem *and* the fix in its message, because the message is
what a user sees: the CLI prints ``str(err)`` as one line, never a traceback.
"""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ContractError",
    "DiskFullError",
    "FencedError",
    "GroupNotFormedError",
    "ProcessGroupInitError",
    "RecoveryLoopError",
    "ReplicaMismatchError",
    "SnapshotDirectoryGoneError",
    "SnapshotWontFitError",
    "StalwartError",
    "StateMismatchError",
    "StepCommittedError",
    "StepFailedError",
    "StorageUnavailableError",
    "UnsafePathError",
    "UnsupportedStateError",
]


class StalwartError(Exception):
    """Base class of every error stalwart raises on purpose."""


class ConfigError(StalwartError, ValueError):
    """A flag, option or config value is invalid."""


class CheckpointError(StalwartError):
    """Base class for checkpoint errors."""


class StepCommittedError(CheckpointError):
    """A write into a step that is already committed (a committed step is immutable)."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists where one was expected."""


class CheckpointFormatError(CheckpointError):
    """A manifest or index cannot be parsed or has an unknown format version."""


class UnsafePathError(CheckpointFormatError):
    """A checkpoint path would leave the checkpoint root: absolute, ``..``, or reached
    through a symbolic link. Nothing is read, written or deleted through it."""


class CheckpointCorruptError(CheckpointError):
    """Stored bytes do not match their checksum, or a referenced file is missing.

    ``problems`` lists every bad item found (file, tensor, what is wrong).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems or [])


class StateMismatchError(CheckpointError):
    """The state being restored does not have the keys or shapes the checkpoint holds."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A state leaf has a type the checkpoint format cannot store without pickle."""


class DiskFullError(CheckpointError, OSError):
    """The storage ran out of space (ENOSPC) during a save."""


class StorageUnavailableError(CheckpointError):
    """The checkpoint storage cannot be used right now: an object store whose endpoint is
    unreachable, whose bucket is missing, that refused the credentials, or that kept failing
    after the retries. Not an ``OSError`` on purpose: a step read while the store is down is
    not damaged and is never quarantined for it."""


class SnapshotWontFitError(CheckpointError):
    """/dev/shm has too little free space for the next snapshot's slot: the snapshot is
    refused before it starts (the older snapshots stay intact), not killed mid-copy."""


class SnapshotDirectoryGoneError(CheckpointError):
    """The snapshot directory a worker writes was removed or replaced under its name
    while it ran: another process owns the rank's slots now (its node was fenced and the
    rank adopted on this host), so this one may write no snapshot there again."""


class FencedError(StalwartError):
    """A member of an old generation tried to commit; it must rejoin first."""


class StepFailedError(StalwartError, RuntimeError):
    """A collective of the current step failed (a peer was lost) or the step had already
    failed: its result would be wrong. ``Session.steps()`` discards the step and redoes
    it after recovery when the loop goes on (``except StepFailedError: continue``)."""


class GroupNotFormedError(StalwartError, RuntimeError):
    """A collective on the job's group ran before its first formation (the first
    ``Session.steps()`` iteration), when no member is connected yet."""


class ProcessGroupInitError(StalwartError, ValueError):
    """``torch.distributed`` was (or is about to be) initialised a second time beside the
    job's default group that ``stalwart.init()`` installs."""


class RecoveryLoopError(StalwartError, RuntimeError):
    """A step failed the same way again after an in-place recovery, with the same
    processes: nothing changed that could make the next attempt different (the ranks no
    longer run the same collectives when the step is redone), so the job ends with a
    verdict rather than recovering forever."""


class ReplicaMismatchError(StalwartError):
    """The members' replicated state (a DDP model's parameters) differs at a formation:
    training on would average gradients of different models."""


class ContractError(ConfigError):
    """The environment a worker was started with (the agent-to-worker contract,
    contract/env.py) is malformed, out of bounds or of another version."""
