"""A replica group's start under --strategy async (runtime/replica_groups/_rejoin.py),
in one process: two groups of one worker over a MemoryStore, their process groups,
tracked state and coordinator stood in for (a group of one forms no process group)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.coordinator import MemoryStore
from stalwart.runtime.replica_groups._rejoin import AsyncRejoin

EVERY = 5


class _Events:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.kinds.append(kind)


class _Snapshots:
    def steps(self) -> list[int]:
        return []  # a first life holds no memory snapshot


class _Tracked:
    def __init__(self, model: torch.nn.Module) -> None:
        self.state: dict[str, Any] = {"model": model}
        self.snapshots = _Snapshots()

    def add(self, name: str, obj: Any) -> None:
        self.state[name] = obj


class _Group:
    pg = None

    def build(self, generation: int) -> None:
        pass


class _Coord:
    def generation(self) -> int:
        return 0


def _group(store: MemoryStore, index: int, wait_s: float) -> tuple[AsyncRejoin, _Events]:
    env = SimpleNamespace(
        replica_group=(index, 0, 1),
        replica_groups=2,
        world_size=2,
        rank=index,
        job="j",
        strategy="async",
        sync_every=EVERY,
        outer_lr=0.7,
        outer_momentum=0.9,
        incarnation="0",  # the agent's count of the group's lives: the first
        hang_ceiling_s=wait_s,
        persist_every=0,
    )
    torch.manual_seed(1337 + index)  # seeded by rank: each group's own initial model
    model = torch.nn.Linear(3, 2)
    events = _Events()
    rejoin = AsyncRejoin(
        env,  # type: ignore[arg-type]
        _Group(),  # type: ignore[arg-type]
        _Tracked(model),  # type: ignore[arg-type]
        _Coord(),  # type: ignore[arg-type]
        store,
        events,  # type: ignore[arg-type]
    )
    rejoin.on_track({"model": model})
    return rejoin, events


def _train(group: AsyncRejoin, steps: range) -> None:
    """Inner steps (a distinct change per group and step), the rounds at boundaries."""
    for step in steps:
        with torch.no_grad():
            for p in group.params.values():
                p.add_(0.01 * step * (group.index + 1))
        group.after_step(step)


def _same(a: AsyncRejoin, b: AsyncRejoin) -> bool:
    return all(torch.equal(a.params[k], b.params[k]) for k in a.params)


@pytest.mark.timeout(30)
def test_a_group_starting_late_starts_from_the_newest_round_without_waiting() -> None:
    """Group 0 did rounds 1-3 alone before group 1 started (round 0 was pruned at round
    2: group 1 waited the hang ceiling for it and failed). Group 1, whose wait is 0.2 s,
    starts at once from round 3's global state, at step 15, is expected from round 4,
    and both groups end round 4 with the same parameters."""
    store = MemoryStore()
    g0, _ = _group(store, 0, 30.0)
    assert g0.join(0, 0).step == 0
    _train(g0, range(1, 3 * EVERY + 1))
    assert g0.outer.round == 3

    g1, events = _group(store, 1, 0.2)
    formation = g1.join(0, 0)
    assert (formation.step, formation.tier, formation.lost) == (3 * EVERY, "transfer", 0)
    assert g1.outer.round == 3 and _same(g0, g1)
    g1.settle(formation, 0.0)
    assert events.kinds == ["note"]  # nothing failed: no replica_rejoin, no recovery_end

    t = threading.Thread(target=_train, args=(g0, range(3 * EVERY + 1, 4 * EVERY + 1)))
    t.start()  # waits in round 4 for group 1's contribution
    _train(g1, range(3 * EVERY + 1, 4 * EVERY + 1))
    t.join()
    assert g0.rounds.agreed(4) == [0, 1]
    assert _same(g0, g1)


@pytest.mark.timeout(30)
def test_a_group_on_time_starts_from_group_0s_initial_parameters() -> None:
    store = MemoryStore()
    g1, events = _group(store, 1, 30.0)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(g1.join(0, 0).step))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waits for round 0
    g0, _ = _group(store, 0, 30.0)
    g0.join(0, 0)
    t.join()
    assert got == [0] and g1.formation is not None and g1.formation.fresh
    assert _same(g0, g1) and events.kinds == []
    t = threading.Thread(target=_train, args=(g0, range(1, EVERY + 1)))
    t.start()
    _train(g1, range(1, EVERY + 1))
    t.join()
    assert g0.rounds.agreed(1) == [0, 1] and _same(g0, g1)
