"""Both rejoins in-process over a MemoryStore with fakes for the group and the tracked
state: each returns one Formation; a failed formation ends the generation and the
members meet again at the next one; elastic members agree on one roster."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.checkpoint import open_storage
from stalwart.contract.env import WorkerEnv
from stalwart.contract.shm_names import SlotNames
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.coordinator.token import create_token_file
from stalwart.runtime.comm._formation import Formation
from stalwart.runtime.elastic import _rejoin as elastic_rejoin
from stalwart.runtime.elastic._joiners import Keys
from stalwart.runtime.elastic._rejoin import ElasticRejoin
from stalwart.runtime.rejoin import _fixed
from stalwart.runtime.rejoin._fixed import FixedRejoin


class _Group:
    def __init__(self, fail: int = 0) -> None:
        self.fail, self.built, self.sizes = fail, [], []
        self.signal_slot, self.signal, self.signalled = False, 0.0, False

    def resize(self, rank: int, world_size: int) -> None:
        self.sizes.append((rank, world_size))

    def build(self, generation: int) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("a member never came")
        self.built.append(generation)


class _Snapshots:
    """A rank's snapshot slots holding ``held`` (a dict step -> value)."""

    def __init__(self, tmp: Path, held: dict[int, float]) -> None:
        self.directory, self.held = str(tmp / "slots"), held

    def steps(self, wait: bool = True) -> list[int]:
        return sorted(self.held)

    def restore(self, state: dict[str, Any], step: int) -> int:
        state["w"].fill_(self.held[step])
        return step

    def latest(self) -> Any:
        return SimpleNamespace(data_size=64, step=max(self.held))


def _tracked(tmp: Path, held: dict[int, float]) -> Any:
    state = {"w": torch.zeros(4)}
    storage = open_storage(str(tmp / "ckpt"))
    return SimpleNamespace(
        env=SimpleNamespace(job="j"),
        names=SlotNames("j"),
        state=state,
        snapshots=_Snapshots(tmp, held),
        checkpoints=SimpleNamespace(storage=storage),
        replicated=True,
        part=None,
        copy_key=None,
        preload=None,
        disk_step=lambda: None,
    )


@pytest.fixture(autouse=True)
def no_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default group and the replica check need a real group (test_world.py)."""
    from stalwart.runtime.comm import _formation

    def formed(group: Any, state: Any, *, step: int, fresh: bool) -> None:
        pass

    for module in (_formation, _fixed, elastic_rejoin):
        if hasattr(module, "formed"):
            monkeypatch.setattr(module, "formed", formed)


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.seen.append((kind, fields))


def _env(**fields: Any) -> WorkerEnv:
    return dataclasses.replace(WorkerEnv.from_environ({}), job="j", hang_ceiling_s=10.0, **fields)


def test_alone_a_fixed_rejoin_starts_fresh(tmp_path: Path) -> None:
    env, group = _env(), _Group()
    position = SimpleNamespace(rank=0, world_size=1, generation=0)
    rejoin = FixedRejoin(
        env, group, _tracked(tmp_path, {}), position, None, None, None, use_memory=True
    )
    assert rejoin.join(0, 0) == Formation(0, 0, 1, 0, "none")
    assert group.built == [0] and not rejoin.resizes


def test_a_failed_formation_is_retried_at_the_next_generation(tmp_path: Path) -> None:
    """The first build fails: the generation ends, the rank meets again at the next one,
    where its own memory holds step 4 (it had completed 5: one step lost)."""
    env, group, events = _env(), _Group(fail=1), _Events()
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="j"))
    tracked = _tracked(tmp_path, {4: 2.5})
    position = SimpleNamespace(rank=0, world_size=1, generation=0)
    rejoin = FixedRejoin(env, group, tracked, position, coord, coord.store, events, use_memory=True)
    f = rejoin.join(0, 5)
    assert f == Formation(1, 0, 1, 4, "memory", lost=1)
    assert group.built == [1] and coord.generation() == 1
    assert torch.equal(tracked.state["w"], torch.full((4,), 2.5))
    restores = [fields for kind, fields in events.seen if kind == "restore"]
    assert [(r["step"], r["tier"]) for r in restores] == [(4, "memory")]


def test_elastic_members_agree_on_one_roster(tmp_path: Path) -> None:
    """Two members join generation 0 together: ranks in member order, one roster."""
    store = MemoryStore()
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    token = tmp_path / "token"
    create_token_file(token)
    keys = Keys("j")
    for member in (0, 1):
        store.put(keys.member(keys.alive, member), b"0")
    out: dict[int, Formation] = {}
    groups = {m: _Group() for m in (0, 1)}

    def member(m: int) -> None:
        env = _env(rank=m, world_size=2, strategy="elastic", token_file=str(token))
        tracked = _tracked(tmp_path / f"m{m}", {})
        rejoin = ElasticRejoin(env, groups[m], tracked, coord, store, None, lambda: None)
        try:
            out[m] = rejoin.join(0, 0)
        finally:
            rejoin.close()

    threads = [threading.Thread(target=member, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: Formation(0, 0, 2, 0, "none"), 1: Formation(0, 1, 2, 0, "none")}
    assert groups[0].sizes == [(0, 2)] and groups[1].sizes == [(1, 2)]
    assert all(g.signal_slot for g in groups.values())  # the stop vote rides the allreduce
