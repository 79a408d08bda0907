"""``MemoryStore``: the in-process :class:`~stalwart.coordinator.store.Store`.

The reference Store, behind StoreServer. Lazy expiry (_waiters.py); a descheduled store
renews every lease before expiring any (_stall.py); ``pin``: docs/detection.md.
"""

from __future__ import annotations

import bisect
import math
import operator
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType

from stalwart.coordinator._memwatch import MemoryWatch
from stalwart.coordinator._stall import StallWatch
from stalwart.coordinator._waiters import ExpiryQueue, Waiters
from stalwart.coordinator.errors import CompactedError, LeaseNotFoundError, StoreClosedError
from stalwart.coordinator.store import (
    Compare,
    Delete,
    Event,
    KeyValue,
    Op,
    Put,
    RangeResult,
    TxnResult,
)

__all__ = ["MemoryStore"]

_DEFAULT_HISTORY = 10_000
_QUIET_PREFIXES = 4096  # prefixes whose empty stretch of history is remembered
# longest lease granted: leases are failure detectors of seconds; a lease that outlives
# the job (or never expires: inf) would keep a lost member's keys forever
MAX_LEASE_TTL = 7 * 86400.0


@dataclass
class _Lease:
    ttl: float
    deadline: float
    keys: set[str] = field(default_factory=set)


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"store keys are non-empty str, got {key!r}")


def _check_value(value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"store values are bytes, got {type(value).__name__}")
    return bytes(value)


_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt}


def _compare_holds(cmp: Compare, kv: KeyValue | None) -> bool:
    actual: int | bytes
    if cmp.target == "value":
        if kv is None:
            return False
        actual = kv.value
    else:
        actual = 0 if kv is None else getattr(kv, cmp.target)
    return bool(_COMPARE[cmp.op](actual, cmp.operand))


class MemoryStore:
    """Thread-safe in-memory Store with revisions, leases and a bounded watch history.

    ``history`` bounds how many past events a watch can replay (older ones are
    compacted away); ``clock`` exists so that tests can drive lease expiry.
    """

    def __init__(
        self,
        *,
        history: int = _DEFAULT_HISTORY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self._lock = threading.Lock()
        self._clock = clock
        self._kv: dict[str, KeyValue] = {}
        self._keys: list[str] = []  # self._kv's keys, sorted: a range is a bisect, not a scan
        self._quiet: dict[str, tuple[int, int]] = {}  # prefix -> (a, b): no event in [a, b]
        self._leases: dict[int, _Lease] = {}
        self._revision, self._first_watchable, self._closed = 0, 1, False
        self._history: list[Event] = []
        self._history_max = history
        self._stall = StallWatch(clock)
        self._expiry, self._waiters = ExpiryQueue(), Waiters(self._lock, self._stall)
        self._planned: float | None = None  # the deadline an event loop's tick() awaits

    @property
    def stalls(self) -> int:
        """How many times the store found it had not run (every lease renewed then)."""
        return self._stall.stalls

    # -- KV -------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The current store revision (0 before the first write)."""
        with self._lock:
            return self._revision

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        return self.txn((), (Put(key, value, lease),)).revision

    def get(self, key: str) -> KeyValue | None:
        _check_key(key)
        with self._lock:
            self._enter_locked()
            return self._kv.get(key)

    def range(self, prefix: str) -> RangeResult:
        with self._lock:
            self._enter_locked()
            kvs = [self._kv[k] for k in self._under_locked(prefix)]
            return RangeResult(kvs, self._revision)

    def delete(self, key: str, *, prefix: bool = False) -> int:
        with self._lock:
            self._enter_locked()
            before = len(self._kv)
            self._apply_locked((Delete(key, prefix),))
            return before - len(self._kv)

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        for op in (*success, *failure):
            _check_key(op.key)
            if isinstance(op, Put):
                _check_value(op.value)
        with self._lock:
            self._enter_locked()
            ok = all(_compare_holds(c, self._kv.get(c.key)) for c in compare)
            self._apply_locked(success if ok else failure)
            return TxnResult(ok, self._revision)

    # -- leases ---------------------------------------------------------

    def grant(self, ttl: float) -> int:
        if not 0 < ttl <= MAX_LEASE_TTL:  # also refuses NaN
            raise ValueError(
                f"lease ttl must be > 0 and <= {MAX_LEASE_TTL:.0f} seconds, got {ttl!r:.40}"
            )
        with self._lock:
            self._enter_locked()
            lease_id = secrets.randbits(62) + 1
            while lease_id in self._leases:
                lease_id = secrets.randbits(62) + 1
            self._leases[lease_id] = _Lease(float(ttl), self._clock() + ttl)
            self._expiry.push(self._leases[lease_id].deadline, lease_id)
            self._waiters.new_deadline()  # the timer may need to wake sooner
            return lease_id

    def keepalive(self, lease: int) -> float:
        with self._lock:
            self._enter_locked()
            entry = self._leases.get(lease)
            if entry is None:
                raise LeaseNotFoundError(
                    f"lease {lease} not found (expired or revoked); grant a new one"
                )
            if entry.deadline != math.inf:  # a pinned lease stays pinned
                entry.deadline = self._clock() + entry.ttl
                self._expiry.push(entry.deadline, lease)
            return entry.ttl

    def time_to_live(self, lease: int) -> float | None:
        with self._lock:
            self._enter_locked()
            entry = self._leases.get(lease)
            if entry is None:
                return None
            return (
                entry.ttl
                if entry.deadline == math.inf
                else max(0.0, entry.deadline - self._clock())
            )

    def pin(self, lease: int) -> None:
        """Keep ``lease`` until revoked: only the store host's own (see the module)."""
        with self._lock:
            self._enter_locked()
            entry = self._leases.get(lease)
            if entry is None:
                raise LeaseNotFoundError(f"lease {lease} gone (expired or revoked); grant one")
            entry.deadline = math.inf  # its heap entries are stale now: skipped

    def revoke(self, lease: int) -> bool:
        with self._lock:
            self._enter_locked()
            if lease not in self._leases:
                return False
            self._drop_lease_locked(lease)
            return True

    # -- watch ----------------------------------------------------------

    def watch(self, prefix: str, start_revision: int | None = None) -> MemoryWatch:
        with self._lock:
            self._enter_locked()
            start = self._revision + 1 if start_revision is None else start_revision
            self._check_watchable_locked(start)
        return MemoryWatch(self, prefix, start)

    def wait_events(
        self,
        prefix: str,
        start_revision: int,
        timeout: float | None,
        *,
        max_bytes: int | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[Event]:
        """Block until events under ``prefix`` at revisions >= ``start_revision`` exist.

        Returns them (whole revisions only, up to ``max_bytes`` of values), or ``[]``
        after ``timeout`` or once ``cancelled()`` (looked at under the lock at each wake:
        set it, then :meth:`wake_waiters`). The server's ``watch`` long-poll."""
        if timeout == 0:  # a poll (the server's event loop parks its long-polls itself)
            with self._lock:
                self._enter_locked()
                self._check_watchable_locked(start_revision)
                return self._collect_locked(prefix, start_revision, max_bytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            waiter = self._waiters.enter(prefix)
            try:
                while True:
                    self._enter_locked()
                    self._check_watchable_locked(start_revision)
                    events = self._collect_locked(prefix, start_revision, max_bytes)
                    if events or (cancelled is not None and cancelled()):
                        return events
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        return []
                    if self._waiters.sleep(waiter, wait, self._until_expiry_locked):
                        self._renew_all_locked()
            finally:
                self._waiters.leave(waiter)

    def poll_events(
        self, prefix: str, start_revision: int, *, max_bytes: int | None = None
    ) -> tuple[list[Event], int]:
        """The events under ``prefix`` from ``start_revision`` now (maybe none), and the
        store's revision they were looked up to: with none, a watch continues from that
        revision + 1 and its next look scans only what was written since (from its old
        start, every empty look scanned the whole history written since then: ~1,000
        events a poll at 1,024 nodes, the store's largest CPU share, docs/scale.md)."""
        with self._lock:
            self._enter_locked()
            self._check_watchable_locked(start_revision)
            events = self._collect_locked(prefix, start_revision, max_bytes)
            return events, self._revision

    def tick(self) -> float | None:
        """For an event loop serving the store (the server's, _loop.py), each pass:
        expire the leases due, after renewing every one if this pass, or any call,
        comes ``STALL_S`` past the deadline the last pass returned (the loop did not
        run: _stall.py); the seconds until the next lease deadline."""
        with self._lock:
            if self._closed:
                return None
            self._enter_locked()
            until = self._until_expiry_locked()
            self._planned = None if until is None else self._clock() + until
            return until

    def listen(self, fn: Callable[[tuple[str, ...] | None], None]) -> None:
        """``fn(keys)`` at every write, ``fn(())`` at a new lease, ``fn(None)`` at a wake
        of every waiter (_waiters.py); called under the store's lock: only take note."""
        with self._lock:
            self._waiters.listen(fn)

    def unlisten(self, fn: Callable[[tuple[str, ...] | None], None]) -> None:
        with self._lock:
            self._waiters.unlisten(fn)

    def _until_expiry_locked(self) -> float | None:
        earliest = self._expiry.earliest(self._leases)
        return None if earliest is None else max(0.0, earliest - self._clock()) + 0.001

    def wake_waiters(self) -> None:  # each sleeping long-poll looks at ``cancelled``
        with self._lock:
            self._waiters.wake_all()

    def close(self) -> None:
        """Wake every waiter; later calls raise :class:`StoreClosedError`."""
        with self._lock:
            self._closed = True
            self._waiters.wake_all()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals (lock held) ------------------------------------------

    def _renew_all_locked(self) -> None:
        """After a stall (see the module): every lease a full ttl from now."""
        now = self._clock()
        for entry in self._leases.values():
            entry.deadline = max(entry.deadline, now + entry.ttl)
        self._expiry.push_all(self._leases)

    def _enter_locked(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; create a new one")
        if self._stall.stalled(self._planned):  # a sleeping watcher's or the loop's
            self._planned = None
            self._renew_all_locked()
        now = self._clock()
        for lease_id in self._expiry.due(now, self._leases):
            self._drop_lease_locked(lease_id)

    def _drop_lease_locked(self, lease_id: int) -> None:
        entry = self._leases.pop(lease_id)
        if entry.keys:
            self._apply_locked([Delete(k) for k in sorted(entry.keys)])

    def _check_watchable_locked(self, start: int) -> None:
        if start < 1:
            raise ValueError(f"start_revision must be >= 1, got {start}")
        if start < self._first_watchable:
            raise CompactedError(
                f"revision {start} is compacted (oldest kept: {self._first_watchable}); "
                "re-read the keys and watch from the revision of that read + 1"
            )

    def _under_locked(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, sorted: O(log K + found), not O(K) (every key
        scanned per range was the store's largest CPU share at 1,024 nodes)."""
        keys = self._keys
        i = bisect.bisect_left(keys, prefix)
        out: list[str] = []
        while i < len(keys) and keys[i].startswith(prefix):
            out.append(keys[i])
            i += 1
        return out

    def _collect_locked(self, prefix: str, start: int, max_bytes: int | None) -> list[Event]:
        """The events under ``prefix`` from ``start``. What an earlier look found empty
        under the same prefix is not scanned again (``_quiet``): N watchers of a prefix
        from N nearby revisions scan the history once between them, not N times."""
        scan_from = start
        quiet = self._quiet.get(prefix)
        merged = quiet is not None and quiet[0] <= start <= quiet[1] + 1
        if quiet is not None and merged:
            scan_from = quiet[1] + 1
        history = self._history
        first = bisect.bisect_left(history, scan_from, key=lambda e: e.kv.mod_revision)
        out: list[Event] = []
        size = 0
        for i in range(first, len(history)):
            event = history[i]
            full = max_bytes is not None and size >= max_bytes
            if full and out and event.kv.mod_revision != out[-1].kv.mod_revision:
                break
            if event.kv.key.startswith(prefix):
                out.append(event)
                size += len(event.kv.value) + len(event.kv.key)
        if not out:
            if len(self._quiet) >= _QUIET_PREFIXES and prefix not in self._quiet:
                self._quiet.clear()  # prefixes come and go (one per generation): bounded
            low = quiet[0] if quiet is not None and merged else start
            self._quiet[prefix] = (low, self._revision)
        return out

    def _apply_locked(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if isinstance(op, Put) and op.lease is not None and op.lease not in self._leases:
                raise LeaseNotFoundError(
                    f"lease {op.lease} not found (expired or revoked); grant a new one"
                )
        rev = self._revision + 1
        events: list[Event] = []
        for op in ops:
            if isinstance(op, Put):
                events.append(self._put_locked(op, rev))
            else:
                keys = (
                    self._under_locked(op.key)
                    if op.prefix
                    else ([op.key] if op.key in self._kv else [])
                )
                for key in keys:
                    old = self._kv.pop(key)
                    del self._keys[bisect.bisect_left(self._keys, key)]
                    if old.lease and old.lease in self._leases:
                        self._leases[old.lease].keys.discard(key)
                    events.append(Event("delete", replace(old, value=b"", mod_revision=rev)))
        if not events:
            return
        self._revision = rev
        self._history.extend(events)
        if len(self._history) > self._history_max * 5 // 4:
            cut = len(self._history) - self._history_max
            self._first_watchable = self._history[cut - 1].kv.mod_revision + 1
            del self._history[:cut]
        self._waiters.wrote(e.kv.key for e in events)

    def _put_locked(self, op: Put, rev: int) -> Event:
        old = self._kv.get(op.key)
        lease = op.lease or 0
        if old is not None and old.lease and old.lease != lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(op.key)
        if lease:
            self._leases[lease].keys.add(op.key)
        kv = KeyValue(
            key=op.key,
            value=_check_value(op.value),
            mod_revision=rev,
            create_revision=old.create_revision if old else rev,
            version=old.version + 1 if old else 1,
            lease=lease,
        )
        if old is None:
            bisect.insort(self._keys, op.key)
        self._kv[op.key] = kv
        return Event("put", kv)
