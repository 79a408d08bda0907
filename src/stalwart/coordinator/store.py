"""The ``Store`` interface every coordinator backend implements.

It is a deliberately small subset of the etcd v3 API (KV with revisions, one-shot
transactions, leases, watches from a revision) so that an etcd backend is a thin
adapter over etcd's JSON gateway, and the embedded :class:`MemoryStore` /
:class:`StoreServer` behave the way etcd does where the coordinator depends on it:

* every write bumps one global *revision*; a transaction's writes share one;
* ``mod_revision == 0`` in a :class:`Compare` means "the key does not exist";
* keys attached to a lease are deleted (with delete events) when it expires;
* a watch replays every event from ``start_revision`` in revision order, or fails
  with :class:`CompactedError` when that history is gone.

Watches are pull-based (:meth:`Watch.get` with a timeout) rather than callbacks:
the coordinator's waits all have deadlines, and a pull with a timeout makes a
deadline a plain loop instead of a thread hand-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "Event",
    "EventType",
    "KeyValue",
    "Op",
    "Put",
    "RangeResult",
    "Store",
    "TxnResult",
    "Watch",
    "iter_events",
    "wait_for",
]

EventType = Literal["put", "delete"]
CompareTarget = Literal["mod_revision", "create_revision", "version", "value"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class KeyValue:
    """One key as stored. ``lease`` is 0 when the key is not attached to a lease."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class Event:
    """A change to a key. For ``delete``, ``kv.value`` is empty and
    ``kv.mod_revision`` is the revision of the deletion."""

    type: EventType
    kv: KeyValue


@dataclass(frozen=True)
class RangeResult:
    """Keys under a prefix, sorted by key, and the store revision they were read at.

    Watching from ``revision + 1`` continues exactly where this snapshot ends.
    """

    kvs: list[KeyValue]
    revision: int


@dataclass(frozen=True)
class TxnResult:
    """Outcome of :meth:`Store.txn`: which branch ran, and the store revision after it."""

    succeeded: bool
    revision: int


@dataclass(frozen=True)
class Compare:
    """A condition on one key, as in etcd: ``target(key) op operand``.

    A missing key compares as 0 for revision/version targets (so
    ``Compare(k, "mod_revision", "==", 0)`` means "k is absent") and fails every
    ``value`` comparison.
    """

    key: str
    target: CompareTarget
    op: CompareOp
    operand: int | bytes

    def __post_init__(self) -> None:
        if self.target == "value" and not isinstance(self.operand, bytes):
            raise TypeError(f"Compare on value needs a bytes operand, got {self.operand!r}")
        if self.target != "value" and (
            not isinstance(self.operand, int) or isinstance(self.operand, bool)
        ):
            raise TypeError(f"Compare on {self.target} needs an int operand, got {self.operand!r}")


@dataclass(frozen=True)
class Put:
    """Transaction operation: set ``key`` (attached to ``lease`` when given)."""

    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    """Transaction operation: delete ``key``, or every key under it when ``prefix``."""

    key: str
    prefix: bool = False


Op = Put | Delete


@runtime_checkable
class Watch(Protocol):
    """A stream of events for one prefix, in revision order, from a start revision."""

    def get(self, timeout: float | None = None) -> list[Event]:
        """Return the next batch of events (non-empty), or ``[]`` once ``timeout`` passes.

        Raises :class:`CompactedError` if the requested history is gone.
        """
        ...

    def close(self) -> None:
        """Stop watching; later :meth:`get` calls raise :class:`StoreClosedError`."""
        ...

    def __enter__(self) -> Watch: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Store(Protocol):
    """Key-value store with revisions, transactions, leases and watches (etcd v3 subset).

    Keys are non-empty ``str``; values are ``bytes``. Every method is thread-safe.
    Lease TTLs are seconds; a backend may round them up (etcd: whole seconds, with
    a server-side minimum), so callers read the granted TTL from :meth:`keepalive`.
    """

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Set ``key``; return the new store revision. Unknown lease: LeaseNotFoundError."""
        ...

    def get(self, key: str) -> KeyValue | None:
        """Return the key's current value and revisions, or ``None`` if absent."""
        ...

    def range(self, prefix: str) -> RangeResult:
        """Return every key starting with ``prefix`` (sorted) and the current revision."""
        ...

    def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it when ``prefix``); return how many."""
        ...

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """Atomically: if every comparison holds run ``success``, else ``failure``."""
        ...

    def grant(self, ttl: float) -> int:
        """Create a lease that expires ``ttl`` seconds from now unless kept alive."""
        ...

    def keepalive(self, lease: int) -> float:
        """Reset the lease's countdown; return its TTL. Gone: LeaseNotFoundError."""
        ...

    def time_to_live(self, lease: int) -> float | None:
        """Seconds until the lease expires, or ``None`` if it no longer exists."""
        ...

    def revoke(self, lease: int) -> bool:
        """End the lease now, deleting its keys; ``False`` if it did not exist."""
        ...

    def watch(self, prefix: str, start_revision: int | None = None) -> Watch:
        """Watch keys under ``prefix`` from ``start_revision`` (default: the next one)."""
        ...

    def close(self) -> None:
        """Release resources (connections, waiters). Idempotent."""
        ...


def wait_for(
    store: Store,
    prefix: str,
    predicate: Callable[[RangeResult], bool],
    timeout: float,
) -> RangeResult | None:
    """Wait until ``predicate(range(prefix))`` holds; ``None`` if ``timeout`` passes first.

    The predicate is re-evaluated on a fresh snapshot after each batch of events,
    so it sees a state the store really had (never a half-applied transaction).
    """
    deadline = time.monotonic() + timeout
    snapshot = store.range(prefix)
    if predicate(snapshot):
        return snapshot
    with store.watch(prefix, snapshot.revision + 1) as watch:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if watch.get(remaining):
                snapshot = store.range(prefix)
                if predicate(snapshot):
                    return snapshot


def iter_events(watch: Watch, timeout: float) -> Iterator[Event]:
    """Yield events from ``watch`` until ``timeout`` seconds pass without any."""
    while True:
        batch = watch.get(timeout)
        if not batch:
            return
        yield from batch
