from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.coordinator import MemoryStore
from stalwart.runtime.steps._accounting import StepAccounting
from stalwart.runtime.steps._cadence import AutoPersist, CadenceRecordError


def _acct(persist_every: int, generation: int = 0, rank: int = 0) -> StepAccounting:
    env: Any = SimpleNamespace(
        persist_every=persist_every, snapshot_budget=0.02, job="j", replica_group=None
    )
    position: Any = SimpleNamespace(rank=rank, generation=generation, world_size=2)
    tracked: Any = SimpleNamespace(part=None, replicated=True, sharded=False)
    return StepAccounting(env, position, tracked, None, None, None)


def test_fixed_persist_cadence_on_rank0_only() -> None:
    acct = _acct(5)
    assert [s for s in range(1, 16) if acct._persist_due(s)] == [5, 10, 15]
    assert not any(_acct(5, rank=1)._persist_due(s) for s in range(1, 16))
    assert not any(_acct(0)._persist_due(s) for s in range(1, 16))


def test_every_async_replica_group_leader_persists_its_own() -> None:
    """Under --strategy async launch rank 1 leads replica group 1: its directory, its
    shard record."""
    acct = _acct(5, rank=1)
    acct.env.replica_group = (1, 0, 1)
    assert [s for s in range(1, 16) if acct._persist_due(s)] == [5, 10, 15]
    assert acct._writer() == (0, 1, "group1.rank0")


def test_ranks_with_their_own_state_persist_it_each() -> None:
    sharded = _acct(5, rank=1)
    sharded.tracked.replicated = False
    assert [s for s in range(1, 16) if sharded._persist_due(s)] == [5, 10, 15]


def test_auto_interval_shrinks_as_failures_are_seen() -> None:
    calm, stormy = _acct(-1, generation=0), _acct(-1, generation=4)
    for a in (calm, stormy):
        a._t_start = time.monotonic() - 100.0
        a._persist_s = 1.0
    assert stormy.auto_interval() < calm.auto_interval()
    assert 60 < calm.auto_interval() < 120  # Daly with a 1 h prior MTBF, 1 s persists
    stormy._last_persist = time.monotonic() - 3600.0
    assert stormy._persist_due(7)


def test_snapshot_cadence_fits_the_stall_budget() -> None:
    acct = _acct(0)
    acct.durations.extend([0.1] * 10)
    acct.stalls = [0.5, 0.5, 0.001, 0.001, 0.001]  # the first two allocate the slots
    assert acct._choose() == 1
    acct.stalls = [0.5, 0.5, 0.01, 0.01, 0.01]  # 10% of a step: every 5 steps
    assert acct._choose() == 5


def test_a_fixed_snapshot_cadence_skips_the_calibration() -> None:
    acct = _acct(0)
    acct.env.snapshot_every = 25
    fixed = StepAccounting(acct.env, acct.position, acct.tracked, None, None, None)
    assert [s for s in range(1, 80) if fixed._snapshot_due(s)] == [25, 50, 75]


def _members(n: int, store: Any, ceiling: float = 300.0) -> list[StepAccounting]:
    def polled() -> int:
        raise AssertionError("the cadence choice waited inside a training step")

    members = []
    for rank in range(n):
        acct = _acct(0, rank=rank)
        env = acct.env
        env.job, env.hang_ceiling_s, env.snapshot_every = "j", ceiling, 0
        coord: Any = SimpleNamespace(generation=polled)
        members.append(StepAccounting(env, acct.position, acct.tracked, None, coord, store))
    return members


def _every_5(acct: StepAccounting) -> None:
    acct.durations.extend([0.1] * 10)
    acct.stalls = [0.5, 0.5, 0.01, 0.01, 0.01]  # 10% of a step: every 5 steps


def test_a_run_resumed_past_the_calibration_step_still_agrees_on_a_cadence() -> None:
    """A run resumed from a checkpoint after step CALIBRATE never sees step == CALIBRATE:
    rank 0 publishes at its first step past it."""
    from stalwart.coordinator import MemoryStore

    ranks = _members(2, MemoryStore(), ceiling=1.0)
    assert [r._snapshot_due(13) for r in ranks] == [True, True]  # no stalls: every step
    assert [r.cadence.every for r in ranks] == [1, 1]  # agreed through the store


def test_members_that_read_the_cadence_at_different_steps_snapshot_the_same_steps() -> None:
    """Rank 1 reads before rank 0 published (it looks again at the next step, no
    polling inside the step); both still snapshot exactly the same steps, so a member
    killed while copying a snapshot holds a step every other member holds too."""
    from stalwart.coordinator import MemoryStore

    rank0, rank1 = _members(2, MemoryStore())
    _every_5(rank0)
    taken: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 31):
        # rank 1 finishes its step before rank 0 (it sees no record at step 6)
        for rank, acct in ((1, rank1), (0, rank0)):
            if acct._snapshot_due(step):
                taken[rank].append(step)
    assert rank1.cadence.every == 5
    assert taken[0] == taken[1] == [1, 2, 3, 4, 5, 6, 7, 10, 15, 20, 25, 30]
    # any two consecutive snapshot steps of one are snapshot steps of the other
    held = set(taken[0][-2:])
    assert held <= set(taken[1])


def test_a_restarted_rank0_adopts_the_jobs_cadence_instead_of_choosing_again() -> None:
    """Under flash, a replacement of rank 0 measures other stalls; were it to publish a
    new choice, the survivors (who keep theirs) and the newcomers would snapshot at
    different steps for good."""
    from stalwart.coordinator import MemoryStore

    store = MemoryStore()
    rank0, rank1 = _members(2, store)
    _every_5(rank0)
    for step in range(1, 12):
        rank0._snapshot_due(step)
        rank1._snapshot_due(step)
    replacement = _members(1, store)[0]  # rank 0 again, measuring every step fits
    replacement.durations.extend([0.1] * 10)
    replacement.stalls = [0.5, 0.5, 0.0, 0.0, 0.0]
    due = [s for s in range(12, 31) if replacement._snapshot_due(s)]
    assert due == [s for s in range(12, 31) if rank1._snapshot_due(s)] == [15, 20, 25, 30]


def test_a_cadence_record_out_of_bounds_is_refused_with_its_fix() -> None:
    import json

    import pytest

    from stalwart.coordinator import MemoryStore
    from stalwart.runtime.steps._cadence import CadenceRecordError

    for doc in ({"every": 0, "from": 3}, {"every": 2}, {"every": True, "from": 1}, "x"):
        store = MemoryStore()
        store.put("/stalwart/j/cadence", json.dumps(doc).encode())
        (rank1,) = _members(2, store)[1:]
        with pytest.raises(CadenceRecordError, match="fresh --rdzv-id"):
            rank1._snapshot_due(7)


def test_the_final_step_is_persisted_when_persisting_is_on() -> None:
    # total 12 with --persist-every 5: steps 5, 10 and the last one, 12
    acct = _acct(5)
    assert [s for s in range(1, 13) if acct._persist_due(s, final=s == 12)] == [5, 10, 12]
    assert _acct(-1)._persist_due(3, final=True)
    assert not _acct(0)._persist_due(12, final=True)
    assert not _acct(5, rank=1)._persist_due(12, final=True)


def _aligned(unit: int, snapshot_every: int, persist_every: int = 0) -> list[tuple[int, bool]]:
    """The (step, persisted) snapshots of 1..20 with steps aligned to ``unit``."""
    acct = _acct(persist_every)
    acct.env.snapshot_every = snapshot_every
    acct = StepAccounting(acct.env, acct.position, acct.tracked, None, None, None)
    acct.alignment.align(unit, 0)
    taken: list[tuple[int, bool]] = []
    acct.snapshot_now = lambda step: taken.append((step, False)) is None  # type: ignore[method-assign]
    acct._start_persist = lambda step, wait: taken.__setitem__(-1, (step, True))  # type: ignore[method-assign]
    for step in range(1, 21):
        acct.maybe_snapshot(step, final=step == 20)
    return taken


def test_with_steps_aligned_to_an_accumulation_cycle_snapshots_land_only_at_its_ends() -> None:
    """--snapshot-every 3 with a cycle of 2: the snapshot due at an odd step is taken at
    the cycle's end, the next step (a rollback never lands inside a cycle)."""
    assert _aligned(2, 3) == [(s, False) for s in (4, 6, 10, 12, 16, 18)]
    assert _aligned(4, 3) == [(s, False) for s in (4, 8, 12, 16, 20)]
    assert _aligned(1, 3) == [(s, False) for s in (3, 6, 9, 12, 15, 18)]
    # a persist due inside a cycle is owed to its end too
    assert [s for s, persisted in _aligned(2, 4, persist_every=5) if persisted] == [6, 10, 16, 20]


def test_an_integrity_check_that_falls_inside_a_cycle_is_refused_with_its_fix() -> None:
    import pytest

    from stalwart.errors import ConfigError

    with pytest.raises(ConfigError, match="--sdc-every 4"):
        _acct(0).alignment.align(2, 3)
    acct = _acct(0)
    acct.alignment.align(2, 4)
    with pytest.raises(ConfigError, match="align once"):
        acct.alignment.align(3, 0)


# ``--persist-every auto`` for a sharded job: the same persist steps on every rank


def test_auto_becomes_the_same_persist_steps_on_every_rank() -> None:
    store = MemoryStore()
    zero, one = AutoPersist(store, "job", 0), AutoPersist(store, "job", 1)
    assert not one.due(10, 10.0, [1.0])  # rank 0 has not chosen yet: nobody persists
    # rank 0 at step 10: Daly's 10 s over a 2 s median step = every 5 steps, from step 12,
    # so step 10 (a multiple of 5) is not a persist point for rank 0 either: rank 1
    # looked before rank 0 published, and a step only one rank wrote never commits
    assert not zero.due(10, 10.0, [2.0, 2.0, 3.0])
    assert (zero.every, zero.start) == (5, 12)
    assert not one.due(11, 99.0, [9.0])  # reads the job's record, ignores its own timing
    assert (one.every, one.start) == (5, 12)
    persisted = [s for s in range(12, 31) if zero.due(s, 1.0, [1.0])]
    assert persisted == [15, 20, 25, 30]
    assert [s for s in range(12, 31) if one.due(s, 1.0, [1.0])] == persisted


def test_a_restarted_rank_0_adopts_the_jobs_record() -> None:
    store = MemoryStore()
    assert not AutoPersist(store, "job", 0).due(8, 10.0, [2.0])  # every 5 from 10
    again = AutoPersist(store, "job", 0)  # a later generation, another MTBF and step time
    assert again.due(10, 70.0, [1.0]) and (again.every, again.start) == (5, 10)


def test_a_malformed_auto_record_is_refused() -> None:
    store = MemoryStore()
    store.put("/stalwart/job/persist-auto", b'{"every": 0, "from": 3}')
    with pytest.raises(CadenceRecordError, match="persist-every auto"):
        AutoPersist(store, "job", 1).due(9, 1.0, [1.0])
