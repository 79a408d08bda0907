from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from stalwart.runtime._accounting import StepAccounting


def _acct(persist_every: int, generation: int = 0, rank: int = 0) -> StepAccounting:
    env: Any = SimpleNamespace(persist_every=persist_every, snapshot_budget=0.02)
    position: Any = SimpleNamespace(rank=rank, generation=generation, world_size=2)
    tracked: Any = SimpleNamespace(part=None, replicated=True, sharded=False)
    return StepAccounting(env, position, tracked, None, None, None)


def test_fixed_persist_cadence_on_rank0_only() -> None:
    acct = _acct(5)
    assert [s for s in range(1, 16) if acct._persist_due(s)] == [5, 10, 15]
    assert not any(_acct(5, rank=1)._persist_due(s) for s in range(1, 16))
    assert not any(_acct(0)._persist_due(s) for s in range(1, 16))


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
    assert [fixed._cadence(s) for s in (1, 3, 50)] == [25, 25, 25]


def test_a_run_resumed_past_the_calibration_step_still_agrees_on_a_cadence() -> None:
    """A run resumed from a checkpoint after step CALIBRATE never sees step == CALIBRATE:
    rank 0 publishes at its first step past it (else every rank waited for the ceiling)."""
    from stalwart.coordinator import MemoryStore

    store = MemoryStore()
    ranks = []
    for rank in (0, 1):
        acct = _acct(0, rank=rank)
        env = acct.env
        env.job, env.hang_ceiling_s, env.snapshot_every = "j", 1.0, 0
        coord: Any = SimpleNamespace(generation=lambda: 0)
        ranks.append(StepAccounting(env, acct.position, acct.tracked, None, coord, store))
    assert [r._cadence(13) for r in ranks] == [1, 1]  # no stalls measured: every step
    assert [r.every for r in ranks] == [1, 1]  # agreed through the store, not timed out


def test_the_cadence_is_read_without_waiting_for_rank0() -> None:
    """A rank that reaches the choice before rank 0 published it snapshots that step and
    looks again at the next one: one store read, no polling inside the step."""
    from stalwart.coordinator import MemoryStore

    def polled() -> int:
        raise AssertionError("the cadence choice waited inside a training step")

    store = MemoryStore()
    ranks = []
    for rank in (0, 1):
        acct = _acct(0, rank=rank)
        env = acct.env
        env.job, env.hang_ceiling_s, env.snapshot_every = "j", 300.0, 0
        coord: Any = SimpleNamespace(generation=polled)
        ranks.append(StepAccounting(env, acct.position, acct.tracked, None, coord, store))
    rank0, rank1 = ranks
    assert rank1._cadence(6) == 1 and rank1.every is None  # not published: every step
    rank0.durations.extend([0.1] * 10)
    rank0.stalls = [0.5, 0.5, 0.01, 0.01, 0.01]  # 10% of a step: every 5 steps
    assert rank0._cadence(6) == 5
    assert rank1._cadence(7) == 5 and rank1.every == 5  # adopted at its next step


def test_the_final_step_is_persisted_when_persisting_is_on() -> None:
    # total 12 with --persist-every 5: steps 5, 10 and the last one, 12
    acct = _acct(5)
    assert [s for s in range(1, 13) if acct._persist_due(s, final=s == 12)] == [5, 10, 12]
    assert _acct(-1)._persist_due(3, final=True)
    assert not _acct(0)._persist_due(12, final=True)
    assert not _acct(5, rank=1)._persist_due(12, final=True)
