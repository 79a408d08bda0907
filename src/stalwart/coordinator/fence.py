"""``Fence``: the proof, checked inside the store's transaction, that a caller is live.

A generation may only be moved by a live member (docs/architecture.md, "Fencing"). A
member's key is attached to its lease, so the store deletes it when the lease expires,
and a member that joins again gets a new key with a new ``create_revision``. A compare
``create_revision(member key) == R`` in the same transaction as the generation's
compare-and-swap therefore holds exactly while the lease that created the key lives:
the etcd recipe for a lease-guarded write, and Kleppmann's fencing token checked by the
storage itself rather than by a client that may be paused or partitioned. A member cut
off from the store, or one whose lease expired while it was stopped, cannot move the
job however late its request arrives.

Agents fence with their own member key; workers with their agent's (the contract's
``fence`` field, docs/worker-contract.md): the workers of a fenced node are fenced too.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.coordinator.store import Compare, Store
from stalwart.errors import FencedError

__all__ = ["Fence"]


@dataclass(frozen=True)
class Fence:
    """The member key whose lease vouches for a caller, and its revision at join."""

    key: str
    """The member key (``/stalwart/JOB/members/ID``), attached to the member's lease."""
    create_revision: int
    """The key's ``create_revision`` when the member joined: a rejoin makes a new one, so
    an old proof never passes for a new lease."""
    holder: str
    """Who holds it, for messages (``node1``; a worker: ``rank 3 of node1``)."""

    def __post_init__(self) -> None:
        if not self.key or self.create_revision <= 0:
            raise ValueError(f"a fence needs a member key and a revision > 0, got {self!r}")

    def compare(self) -> Compare:
        """The compare that holds while the lease lives (put it in the transaction)."""
        return Compare(self.key, "create_revision", "==", self.create_revision)

    def holds(self, store: Store) -> bool:
        """Whether the lease still lives (one read: a refused transaction asks why)."""
        kv = store.get(self.key)
        return kv is not None and kv.create_revision == self.create_revision

    def refused(self, what: str) -> FencedError:
        """The error of a refused write: the caller's lease is gone."""
        return FencedError(
            f"{self.holder} cannot {what}: its lease is gone (it could not reach the "
            "coordinator for longer than the lease, so the job went on without it); "
            "it stops here and must join again as a new member"
        )
