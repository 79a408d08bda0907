"""Exceptions raised by the coordinator and its stores.

They live beside the coordinator (not in :mod:`stalwart.errors`) because only code
that talks to a store can meet them; every one still subclasses
:class:`stalwart.errors.StalwartError`, so the CLI's one-line error printing applies.
Each message names the problem and what to do about it.
"""

from __future__ import annotations

from stalwart.errors import StalwartError

__all__ = [
    "AlreadyCommittedError",
    "AuthenticationError",
    "BlocklistedError",
    "CompactedError",
    "CoordinatorError",
    "FrameTooLargeError",
    "LeaseNotFoundError",
    "MemberExistsError",
    "ProtocolError",
    "RendezvousTimeoutError",
    "StoreClosedError",
    "StoreError",
    "StoreUnavailableError",
    "TokenFileError",
]


class CoordinatorError(StalwartError):
    """Base class of coordinator and store errors."""


class StoreError(CoordinatorError):
    """Base class of errors raised by a :class:`~stalwart.coordinator.store.Store`."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The store could not be reached before the deadline (server down or unreachable)."""


class StoreClosedError(StoreError):
    """The store (or the client) was closed; create a new one to continue."""


class AuthenticationError(StoreError):
    """The peer does not hold the job token (wrong token file, or another job's server)."""


class ProtocolError(StoreError):
    """A frame broke the wire protocol: bad framing, bad JSON, unknown op or version."""


class FrameTooLargeError(ProtocolError):
    """A frame, key or value exceeds the configured size limit."""


class LeaseNotFoundError(StoreError):
    """The lease expired or was revoked; whoever held it must start over (e.g. rejoin)."""


class CompactedError(StoreError):
    """A watch asked for revisions the store no longer keeps; re-read and watch from now."""


class TokenFileError(CoordinatorError):
    """The job token file is missing, empty, or readable by other users."""


class BlocklistedError(CoordinatorError):
    """The member is blocklisted and may not join; ``unblock`` it to readmit it."""


class MemberExistsError(CoordinatorError):
    """A live member with the same id already holds a lease."""


class RendezvousTimeoutError(CoordinatorError, TimeoutError):
    """Not enough members arrived at a rendezvous or barrier before its deadline."""


class AlreadyCommittedError(CoordinatorError):
    """This step or checkpoint was already committed; a commit happens exactly once."""
