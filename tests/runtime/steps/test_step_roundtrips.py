"""A rank's training step makes no store round trip in steady state (issue 31): at 1,024
nodes of 8 ranks a read per rank per step is tens of thousands of requests a second
on the coordinator. Counted with a store that counts every call it forwards."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from stalwart.coordinator import Compare, KeyValue, MemoryStore, Op, RangeResult, TxnResult
from stalwart.runtime.steps._accounting import StepAccounting
from stalwart.runtime.steps._cadence import CALIBRATE


class CountingStore:
    """Forwards to a :class:`MemoryStore` and counts the round trips (one per call)."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.calls = 0

    def get(self, key: str) -> KeyValue | None:
        self.calls += 1
        return self.inner.get(key)

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self.calls += 1
        return self.inner.put(key, value, lease)

    def range(self, prefix: str) -> RangeResult:
        self.calls += 1
        return self.inner.range(prefix)

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        self.calls += 1
        return self.inner.txn(compare, success, failure)

    def __getattr__(self, name: str) -> Any:  # anything else is a call too: refused
        raise AssertionError(f"a step called store.{name}")


def _ranks(n: int, store: CountingStore, snapshot_every: int = 0) -> list[StepAccounting]:
    out = []
    for rank in range(n):
        env: Any = SimpleNamespace(
            persist_every=0,
            snapshot_budget=0.02,
            job="j",
            replica_group=None,
            snapshot_every=snapshot_every,
        )
        position: Any = SimpleNamespace(rank=rank, generation=0, world_size=n)
        tracked: Any = SimpleNamespace(part=None, replicated=True, sharded=False)
        coord: Any = SimpleNamespace()  # any coordinator call fails the test
        acct = StepAccounting(env, position, tracked, None, coord, store)  # type: ignore[arg-type]
        acct.durations.extend([0.1] * 10)
        acct.stalls = [0.5, 0.5, 0.01, 0.01, 0.01]  # rank 0 chooses every 5 steps
        out.append(acct)
    return out


def _step(acct: StepAccounting, step: int) -> bool:
    """What the session asks the accounting at every step's end, store-wise."""
    return acct._snapshot_due(step) or acct._persist_due(step)


def test_a_ranks_step_makes_no_store_round_trip_once_the_cadence_is_chosen() -> None:
    store = CountingStore(MemoryStore())
    ranks = _ranks(4, store)
    per_step: list[int] = []
    for step in range(1, 201):
        before = store.calls
        for acct in reversed(ranks):  # the others finish a step before rank 0 publishes
            _step(acct, step)
        per_step.append(store.calls - before)
    assert all(acct.cadence.every == 5 for acct in ranks)
    assert sum(per_step[: CALIBRATE - 1]) == 0  # calibrating: no store at all
    assert sum(per_step[CALIBRATE + 2 :]) == 0  # steady state: none per rank per step


def test_a_cadence_never_published_costs_a_bounded_number_of_reads() -> None:
    """Rank 0 not there yet (or no collective per step): the others look at steps 0, 1,
    2, 4, 8, ... after their first look, not at every step."""
    store = CountingStore(MemoryStore())
    others = _ranks(3, store)[1:]
    for step in range(1, 1025):
        for acct in others:
            assert _step(acct, step)  # without a cadence every step is snapshotted
    assert store.calls <= 2 * (2 + 10)  # log2(1024) reads each, not 1,024
    late = _ranks(1, store)[0]  # rank 0 publishes now: the others learn it, and agree
    late._snapshot_due(1025)
    for step in range(1025, 4096):
        for acct in others:
            _step(acct, step)
    assert [acct.cadence.every for acct in others] == [5, 5]


def test_a_fixed_cadence_never_touches_the_store() -> None:
    store = CountingStore(MemoryStore())
    for acct in _ranks(2, store, snapshot_every=10):
        for step in range(1, 101):
            _step(acct, step)
    assert store.calls == 0
