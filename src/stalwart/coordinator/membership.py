"""Members: a lease-backed presence in the job, kept alive by heartbeats.

A member's key is attached to its lease, so when the member (or its whole node)
stops heartbeating, the store itself deletes the key at lease expiry and every
watcher sees a delete event: lease expiry *is* the failure signal, with no
separate failure detector to trust.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from stalwart.coordinator.errors import LeaseNotFoundError, StoreClosedError, StoreError
from stalwart.coordinator.store import Store, Watch
from stalwart.logs import get_logger

__all__ = ["MAX_RENEWALS_IN_FLIGHT", "Member", "MemberEvent", "MemberInfo", "MembershipWatch"]

_log = get_logger(__name__)

MAX_RENEWALS_IN_FLIGHT = 3
"""Hedged renewals a member keeps outstanding at most (one sent per heartbeat interval):
at the default interval of a quarter lease, three cover the lease's last three quarters,
and a store that answers none of them costs at most three waiting threads."""


@dataclass(frozen=True)
class MemberInfo:
    """What a member published when it joined."""

    member_id: str
    node: str
    joined_at: float  # wall-clock seconds (time.time()) on the member's host
    info: dict[str, Any]

    def to_bytes(self) -> bytes:
        doc = {"member_id": self.member_id, "node": self.node, "joined_at": self.joined_at}
        return json.dumps({**doc, "info": self.info}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> MemberInfo:
        doc = json.loads(data)
        return cls(doc["member_id"], doc["node"], float(doc["joined_at"]), dict(doc["info"]))


@dataclass(frozen=True)
class MemberEvent:
    """A member joined (its key appeared) or left (its key was deleted: lease expiry,
    revocation or removal)."""

    kind: Literal["joined", "left"]
    member_id: str
    revision: int


class MembershipWatch:
    """Join/leave events of a job's members, in revision order."""

    def __init__(self, watch: Watch, prefix: str) -> None:
        self._watch = watch
        self._prefix = prefix

    def get(self, timeout: float | None = None) -> list[MemberEvent]:
        """Next batch of membership events, or ``[]`` after ``timeout``."""
        return [
            MemberEvent(
                "joined" if e.type == "put" else "left",
                e.kv.key[len(self._prefix) :],
                e.kv.mod_revision,
            )
            for e in self._watch.get(timeout)
        ]

    def close(self) -> None:
        self._watch.close()

    def __enter__(self) -> MembershipWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Member:
    """A joined member: its id, its lease, and an optional heartbeat thread.

    Created by :meth:`Coordinator.join`. Call :meth:`heartbeat` yourself or start
    the background thread with :meth:`start_heartbeat`; :meth:`leave` (or leaving
    the ``with`` block) revokes the lease so the others see the departure at once.
    """

    def __init__(
        self,
        store: Store,
        member_id: str,
        lease: int,
        ttl: float,
        heartbeat_interval: float,
    ) -> None:
        self.store = store
        self.member_id = member_id
        self.lease = lease
        self.ttl = ttl
        self.heartbeat_interval = heartbeat_interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: BaseException | None = None
        self._outcomes: queue.SimpleQueue[tuple[float, Exception | None] | None]
        self._outcomes = queue.SimpleQueue()  # renewals' (sent, error) for the heartbeat thread
        self._tickets: queue.SimpleQueue[bool] = queue.SimpleQueue()  # False: a renewer ends
        self._renewers = 0  # renewer threads started (by the heartbeat thread only)
        self.renewal_sent = time.monotonic()
        """When (monotonic) the last renewal that succeeded was *sent*: the store renewed
        the lease no earlier, so it expires no earlier than this plus the TTL."""

    @property
    def lost(self) -> BaseException | None:
        """Why the background heartbeat gave up (lease gone), or ``None``."""
        return self._lost

    def heartbeat(self) -> None:
        """Renew the lease. :class:`LeaseNotFoundError` means it expired: rejoin."""
        self.store.keepalive(self.lease)

    def start_heartbeat(
        self, on_lost: Callable[[BaseException], None] | None = None, *, give_up: bool = True
    ) -> None:
        """Heartbeat every ``heartbeat_interval`` seconds in a thread.

        Renewals are *hedged*: one is sent every interval whether or not the ones before
        it answered, up to :data:`MAX_RENEWALS_IN_FLIGHT` at once, each on a connection
        of its own (the store clients give concurrent calls separate connections). Over
        a lossy link a renewal can wait several seconds on TCP's retransmission backoff,
        then reconnect with SYNs that are lost too: measured across two hosts at 30%
        loss, one such renewal let a 10 s lease expire while the link still passed
        traffic. A second renewal on another connection has its own, independent luck;
        the lease is kept by whichever answers first.

        Transient store errors are retried until the lease would have expired
        anyway (forever with ``give_up=False``: etcd extends every lease when it comes
        back from an outage, so only :class:`LeaseNotFoundError` proves the lease
        gone); then (or on :class:`LeaseNotFoundError`) ``on_lost`` is called once,
        from the heartbeat thread, and the thread ends.
        """
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        self._thread = threading.Thread(
            target=self._run, args=(on_lost, give_up), name=f"stalwart-heartbeat-{self.member_id}"
        )
        self._thread.daemon = True
        self._thread.start()

    def _run(self, on_lost: Callable[[BaseException], None] | None, give_up: bool) -> None:
        try:
            self._beat(on_lost, give_up)
        finally:
            for _ in range(self._renewers):  # each ends once its renewal (if any) returns
                self._tickets.put(False)

    def _beat(self, on_lost: Callable[[BaseException], None] | None, give_up: bool) -> None:
        next_send = time.monotonic() + self.heartbeat_interval
        in_flight = 0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                next_send = now + self.heartbeat_interval
                if in_flight < MAX_RENEWALS_IN_FLIGHT:
                    in_flight += 1
                    self._send_renewal(in_flight)
            try:
                outcome = self._outcomes.get(timeout=max(0.0, next_send - time.monotonic()))
            except queue.Empty:
                continue
            if outcome is None:  # leave() woke us
                return
            in_flight -= 1
            sent, error = outcome
            if error is None:
                self.renewal_sent = max(self.renewal_sent, sent)
                continue
            if isinstance(error, StoreClosedError) or self._stop.is_set():
                return
            transient = not isinstance(error, LeaseNotFoundError)
            if transient and (not give_up or time.monotonic() - self.renewal_sent < self.ttl):
                _log.warning("heartbeat of %s failed, retrying: %s", self.member_id, error)
                continue
            self._lost = error
            _log.error("member %s lost its lease: %s", self.member_id, error)
            if on_lost is not None:
                on_lost(error)
            return

    def _send_renewal(self, in_flight: int) -> None:
        """Hand one renewal to a renewer thread, starting one more only when every
        renewer is busy (``in_flight`` renewals outstanding, this one included): a store
        that answers keeps one renewer thread, not a thread per renewal."""
        if in_flight > self._renewers:
            self._renewers += 1
            name = f"stalwart-renewal-{self.member_id}-{self._renewers}"
            threading.Thread(target=self._renewer, name=name, daemon=True).start()
        self._tickets.put(True)

    def _renewer(self) -> None:
        """Renew the lease once per ticket; each outcome goes to the heartbeat thread."""
        while self._tickets.get():
            sent = time.monotonic()
            try:
                self.heartbeat()
            except Exception as exc:  # a store error, or a bug: the heartbeat thread judges
                self._outcomes.put((sent, exc))
                continue
            self._outcomes.put((sent, None))

    def leave(self) -> None:
        """Stop heartbeating and revoke the lease (the member's keys vanish now)."""
        self._stop.set()
        self._outcomes.put(None)  # wake the heartbeat thread now
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self.store.revoke(self.lease)
        except (StoreError, OSError) as exc:  # it will expire on its own
            _log.warning("could not revoke the lease of %s: %s", self.member_id, exc)

    def __enter__(self) -> Member:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.leave()
