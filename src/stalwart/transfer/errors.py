"""Errors of the snapshot transfer; each message names the problem and the fix."""

from __future__ import annotations

from stalwart.errors import StalwartError

__all__ = [
    "ChunkMismatchError",
    "SourceChangedError",
    "TransferAuthError",
    "TransferError",
    "TransferProtocolError",
]


class TransferError(StalwartError):
    """A snapshot transfer failed; nothing of it became visible at the receiver."""


class TransferAuthError(TransferError):
    """The peer does not hold the job token (wrong token file, or another job's peer)."""


class TransferProtocolError(TransferError):
    """The peer broke the transfer protocol (docs/transfer.md): bad frame, field or size."""


class ChunkMismatchError(TransferError):
    """Received bytes do not match their xxh3-128; ``chunks`` lists the bad chunk indices."""

    def __init__(self, message: str, chunks: list[int] | None = None) -> None:
        super().__init__(message)
        self.chunks: list[int] = list(chunks or [])


class SourceChangedError(TransferError):
    """The source slot was overwritten by a newer snapshot while it was being sent."""
