"""The snapshot cadence: at which steps every member of the job takes a snapshot.

A rollback target must be a step *every* member holds in memory, and each member keeps
two snapshots (double-buffered slots). So the members must snapshot at the same steps:
if one snapshots steps 6 and 10 while another took 5 and 10, a member killed while
copying step 10 holds {6} (or {5}) and the others {5 or 6, 10}: no common step, and a
flash recovery falls back to disk or to a restart from step 0.

The first ``CALIBRATE`` steps are snapshotted every step while stall and step time are
measured. Then rank 0 chooses ``every`` (1 if the median stall fits the budget, else the
smallest k that does) and publishes, once for the whole job, the record ``{"every": k,
"from": F}`` at ``/stalwart/<job>/cadence`` (created only if absent: a restarted rank 0
adopts the job's record, it does not choose again). Every step before ``F`` is
snapshotted, every step ``s >= F`` with ``s % k == 0``. Rank 0 sets ``F`` two steps
after the step it publishes at, and the others read the record without waiting: at their
first two steps from ``CALIBRATE`` on, then at steps ``2^i`` after the first (a bounded
number of reads, none per step once it is known or while it is missing for long:
docs/scale.md counts a rank's store round trips per step). In a job with a collective in
every step, a member finishing step ``F - 1`` has waited for rank 0 in that step's
collective, which rank 0 entered after publishing, so every member knows the record
before ``F`` and all take the same snapshots. (The previous scheme published per
generation and switched each rank at the step it happened to read the record: ranks
disagreed on a few steps after the choice, and for good after a restarted rank 0 chose
again.)

A member that learns the record only after ``F`` (a job without a collective per step)
took extra snapshots meanwhile; it says so once, since until two common snapshots have
passed a failure may find no common step.

The persist cadence of a sharded job under ``--persist-every auto`` is the same kind of
record (:class:`AutoPersist`): a sharded step is committed only when every rank wrote it
(checkpoint/commit.py), so every rank must persist at the same steps.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import TYPE_CHECKING

from stalwart.coordinator import Compare, Put
from stalwart.errors import StalwartError
from stalwart.logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    from stalwart.coordinator import Store
    from stalwart.runtime.comm._formation import Position

__all__ = [
    "CALIBRATE",
    "AutoPersist",
    "CadenceRecordError",
    "SnapshotCadence",
    "choose_every",
    "parse_every",
]

CALIBRATE = 6
_MAX_EVERY = 1_000_000
_MAX_STEP = 1 << 62
_log = get_logger(__name__)


class CadenceRecordError(StalwartError):
    """The job's cadence record in the store is not one this version wrote."""


def parse_every(raw: bytes, key: str, what: str = "snapshot cadence") -> tuple[int, int]:
    """(every, from) of a ``{"every": k, "from": F}`` record (the snapshot cadence's,
    and a sharded job's ``--persist-every auto`` choice), bounds-checked."""
    try:
        doc = json.loads(raw.decode("ascii"))
        every, start = doc["every"], doc["from"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as err:
        raise CadenceRecordError(
            f"the {what} record at {key} is malformed ({err}): another program "
            "wrote it; use a fresh --rdzv-id"
        ) from None
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (every, start))
    if not ok or not (1 <= every <= _MAX_EVERY and 0 <= start <= _MAX_STEP):
        raise CadenceRecordError(
            f"the {what} record at {key} has every={every!r} from={start!r}, "
            f"outside [1, {_MAX_EVERY}] x [0, 2^62]: use a fresh --rdzv-id"
        )
    return every, start


class SnapshotCadence:
    """One member's view of the job's snapshot cadence (the record's only reader/writer
    in the worker). ``fixed`` > 0 (``--snapshot-every``) skips the calibration."""

    def __init__(self, job: str, position: Position, store: Store | None, fixed: int = 0) -> None:
        self.key = f"/stalwart/{job}/cadence"
        self.position, self.store = position, store  # the live rank: elastic renumbers
        self.every: int | None = fixed if fixed > 0 else None  # None: measured, then set
        self.start = 0  # the first step at which ``every`` applies
        self._fallback: list[int] = []  # steps snapshotted because no record was known
        self._first: int | None = None  # the first step at which the record was looked for

    def due(self, step: int, choose: Callable[[], int]) -> bool:
        """Is step ``step`` a snapshot step? ``choose`` is rank 0's measured choice."""
        every = self._every(step, choose)
        if every is None:
            if step >= CALIBRATE:
                self._fallback.append(step)
            return True
        return step < self.start or step % every == 0

    def _every(self, step: int, choose: Callable[[], int]) -> int | None:
        if self.every is not None:
            return self.every
        if step < CALIBRATE:
            return None
        store = self.store
        if store is None:  # alone: nobody to agree with
            self.every = choose()
            return self.every
        if not self._look(step):
            return None  # snapshotted; the record is looked for again at a later step
        found = store.get(self.key)
        if found is None and self.position.rank == 0:
            doc = json.dumps({"every": choose(), "from": step + 2}).encode()
            store.txn([Compare(self.key, "mod_revision", "==", 0)], [Put(self.key, doc)])
            found = store.get(self.key)  # the record that won is the job's, ours or not
        if found is None:
            return None  # not published yet: this step is snapshotted, look again next
        self.every, self.start = parse_every(found.value, self.key)
        late = [s for s in self._fallback if s >= self.start and s % self.every]
        if late:
            _log.warning(
                "rank %d learned the snapshot cadence (every %d from step %d) late and "
                "snapshotted steps %s besides: until two common snapshots have passed, a "
                "failure may find no step every member holds",
                self.position.rank,
                self.every,
                self.start,
                late[:4],
            )
        self._fallback.clear()
        return self.every

    def _look(self, step: int) -> bool:
        if self._first is None or step < self._first:  # a rollback restarts the count
            self._first = step
        return _looks_at(step - self._first)


def _looks_at(offset: int) -> bool:
    """Whether a member that has not found the record reads it ``offset`` steps after its
    first look: at 0 and 1 (rank 0 publishes at the first, so a job with a collective
    per step finds it at the second), then at powers of two (a job without one)."""
    return offset <= 1 or offset & (offset - 1) == 0


def choose_every(stalls: list[float], durations: list[float], budget_fraction: float) -> int:
    """The smallest k whose median stall fits ``budget_fraction`` of the median step
    (1 when it fits every step, or before anything was measured)."""
    stalls = stalls[2:]  # the first snapshot into each slot allocates it
    if not stalls or not durations:
        return 1
    stall = statistics.median(stalls)
    budget = budget_fraction * statistics.median(durations)
    return 1 if stall <= budget or budget <= 0 else math.ceil(stall / budget)


class AutoPersist:
    """``--persist-every auto`` for a sharded job: every rank must persist at the same
    steps (a step is committed only when every rank wrote it: checkpoint/commit.py).

    Rank 0 turns Daly's interval into a step count once and publishes one record for the
    job, ``{"every": k, "from": F}`` at ``/stalwart/<job>/persist-auto``, created only if
    absent (a restarted rank 0 adopts the job's record, it does not choose again), with
    ``F`` two steps after the step it publishes at: the snapshot cadence's scheme (the
    module's docstring says why every member then knows the record before ``F``). No
    rank persists before it knows the record, and every rank persists the steps
    ``s >= F`` with ``s % k == 0``, so a rank reading it a step late still persists the
    same steps. (The previous scheme published a choice per generation that applied at
    once: a rank that read it late missed persist steps, which then never committed.)"""

    def __init__(self, store: Store | None, job: str, rank: int) -> None:
        self.store, self.rank = store, rank
        self.key = f"/stalwart/{job}/persist-auto"
        self.every: int | None = None
        self.start = 0  # the first step at which ``every`` applies

    def due(self, step: int, interval_s: float, step_s: list[float]) -> bool:
        """Whether ``step`` is a persist point; ``interval_s``: Daly's interval now,
        ``step_s``: recent step durations (rank 0 turns one into steps with the other)."""
        if self.every is None:
            self._learn(step, interval_s, step_s)
        return self.every is not None and step >= self.start and step % self.every == 0

    def _learn(self, step: int, interval_s: float, step_s: list[float]) -> None:
        store = self.store
        if store is None:  # alone: nobody to agree with
            if step_s:
                self.every = _persist_steps(interval_s, step_s)
            return
        found = store.get(self.key)
        if found is None and self.rank == 0 and step_s:
            every = _persist_steps(interval_s, step_s)
            doc = json.dumps({"every": every, "from": step + 2})
            store.txn([Compare(self.key, "mod_revision", "==", 0)], [Put(self.key, doc.encode())])
            found = store.get(self.key)  # the record that won is the job's, ours or not
        if found is not None:
            self.every, self.start = parse_every(found.value, self.key, "--persist-every auto")


def _persist_steps(interval_s: float, step_s: list[float]) -> int:
    return max(1, math.ceil(interval_s / max(statistics.median(step_s), 1e-6)))
