"""The partition grace: a lease that expired in silence is *missing*, not lost, for a while.

A partition a little longer than the node lease (3 s) used to cost a node for the rest
of the job. With a grace (``--partition-grace``, docs/detection.md):

- the node that would adopt a silently expired node (:class:`MissingNodes`) waits
  ``grace`` seconds after it saw the expiry before it declares the node lost, and then
  declares it in **one transaction** (:func:`claim_lost`) that also checks the node's
  member key is still absent and writes the blocklist entry: a node that rejoined
  meanwhile makes the claim fail (it is a member again), and a node that tries to rejoin
  after the claim finds itself blocklisted (``Coordinator.join`` compares the entry);
- the node itself (:class:`RejoinClock`, with agent/cluster/_cluster.py's ``rejoin``) keeps its
  workers and tries to join again until ``renewal sent + lease + grace - margin`` on its
  own clock; the store cannot have renewed the lease before that renewal was sent, so the
  expiry, and the adopter's grace after it, start no earlier. Past that it is fenced.

A process death (the peer watch's closed connection), a decided cut (``cut-node``: the
data plane watch, or ``--on-degraded evict``), a node that cordoned itself and
``grace == 0`` stay immediate. No split brain: a member without a lease moves nothing
(every bump is lease-guarded), and the loss that lets the job move on is one atomic
claim against the member key.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from stalwart.agent._types import EventSink, Say
from stalwart.agent.cluster._fencing import NodeLease
from stalwart.coordinator import (
    BlockEntry,
    BlocklistedError,
    Compare,
    Member,
    Put,
    StoreError,
)
from stalwart.errors import FencedError

__all__ = [
    "REJOIN_MARGIN_S",
    "MissingNodes",
    "Rejoin",
    "RejoinClock",
    "claim_lost",
    "hand_fence",
    "noting",
]

REJOIN_MARGIN_S = 0.5
"""What the node's deadline keeps back from the adopter's earliest action: clock drift over
a grace of seconds is microseconds; the rest is a store call in flight at the deadline."""
_RETRY_S = 0.2  # between two rejoin attempts


class MissingNodes:
    """The adopter's side: which silently expired nodes are due to be declared lost."""

    def __init__(
        self,
        grace_s: float,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._grace_s, self._say, self._clock = grace_s, say, clock
        self._since: dict[int, float] = {}  # node -> when this agent first saw it missing

    def due(self, gone: set[int], live: set[int], loud: Callable[[int], bool]) -> set[int]:
        """Of the nodes ``gone`` (lease expired, not yet handled), those to declare lost
        now: every ``loud`` one (a death, a decided cut) and the silent ones ``grace``
        seconds after they went missing. Nodes back in ``live`` are forgotten."""
        now = self._clock()
        for n in sorted(set(self._since) & live):
            away = now - self._since.pop(n)
            self._say(f"node {n} rejoined the job {away:.2f} s after its lease expired")
        for n in sorted(set(self._since) - gone):
            del self._since[n]  # handled elsewhere (it said goodbye, another adopter)
        out = set()
        for n in sorted(gone):
            if self._grace_s <= 0 or loud(n):
                self._since.pop(n, None)
                out.add(n)
            elif n not in self._since:
                self._since[n] = now
                self._say(
                    f"node {n}'s lease expired with no other sign of a fault: it may rejoin "
                    f"within the partition grace ({self._grace_s:.1f} s) before it is "
                    "declared lost"
                )
            elif now - self._since[n] >= self._grace_s:
                del self._since[n]
                out.add(n)
        return out

    @property
    def waiting(self) -> bool:
        """Whether some node is still within its grace (look again at the next poll)."""
        return bool(self._since)


def claim_lost(
    store: Any, root: str, node: int, *, by: int, fence: list[Compare], block: bool = True
) -> bool:
    """Declare ``node`` lost, once, in one transaction: the adoption claim and the
    blocklist entry, only while its member key is absent (it did not rejoin), nobody
    claimed it before, and (``fence``) the claimant still holds its own lease.
    ``block=False``: a node that cordoned itself is blocklisted already, with its own
    reason, which the claim keeps."""
    member, adopted = f"{root}/members/node{node}", f"{root}/adopted/node{node}"
    entry = BlockEntry(f"node{node}", "lease expired: node lost", time.time(), 0)
    compares = [
        Compare(adopted, "mod_revision", "==", 0),
        Compare(member, "mod_revision", "==", 0),
        *fence,
    ]
    ops = [Put(adopted, json.dumps({"by": by}).encode())]
    if block:
        ops.append(Put(f"{root}/blocklist/node{node}", json.dumps(asdict(entry)).encode()))
    return bool(store.txn(compares, ops).succeeded)


class RejoinClock:
    """The cut node's side: when to try to rejoin, and when it is too late."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next = 0.0

    @staticmethod
    def deadline(renewal_sent: float, lease_s: float, grace_s: float) -> float:
        """The last moment (monotonic) this node may still rejoin: before the adopter's
        grace can have ended."""
        return renewal_sent + lease_s + grace_s - REJOIN_MARGIN_S

    def attempt(self, deadline: float) -> bool | None:
        """True: try to rejoin now; False: not yet (retry spacing); None: too late."""
        now = self._clock()
        if now >= deadline:
            return None
        if now < self._next:
            return False
        self._next = now + _RETRY_S
        return True


class Rejoin:
    """The cut node's rejoin within the grace: owns the attempts, reports to the lease."""

    def __init__(
        self, lease: NodeLease, say: Callable[[str], None], clock: RejoinClock | None = None
    ) -> None:
        self._lease, self._say, self._clock = lease, say, clock or RejoinClock()

    def tick(
        self,
        store: Any,
        old: Member,
        join: Callable[[], Member],
        become: Callable[[Member], None],
    ) -> None:
        """While the lease is missing: resume it if the store still has it (the store was
        slow, not away), else join again; fenced past the deadline or once blocklisted."""
        lease = self._lease
        if lease.missing is None or lease.lost_reason is not None:
            return
        why, deadline = lease.missing
        go = self._clock.attempt(deadline)
        if go is None:
            return lease.lost(f"{why}; it did not rejoin within the partition grace")
        if not go:
            return
        try:
            kv = store.get(lease.key)
            if kv is not None and kv.create_revision == lease.revision:
                become(Member(store, old.member_id, old.lease, old.ttl, old.heartbeat_interval))
                self._say(f"node {lease.node} renewed its lease again ({why})")
                return
            become(join())
        except BlocklistedError as err:
            return lease.lost(f"{why}; it may not rejoin ({err})")
        except (StoreError, OSError, FencedError):
            return  # the store still away: again in a moment, until the deadline
        self._say(
            f"node {lease.node} rejoined the job after its lease expired ({why}); its "
            "workers kept their ranks"
        )


def hand_fence(path: str, node: int, revision: int) -> None:
    """Write ``node:revision`` for this node's workers (runtime/comm/_coord.py reads it before
    every bump and rendezvous): after a rejoin their fence is the new member key's."""
    with open(f"{path}.tmp", "w") as f:
        f.write(f"{node}:{revision}")
    os.replace(f"{path}.tmp", path)


def noting(events: EventSink, say: Say) -> Callable[[str], None]:
    """What the grace has to say: one line and a ``note`` event each."""

    def note(line: str) -> None:
        events.emit("note", message=line)
        say(line)

    return note
