"""A Formation is one frozen value; the session is its only writer; the shared "build
the group, else end the generation and retry" path (runtime/comm/_formation.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.errors import ReplicaMismatchError
from stalwart.runtime.comm import _formation
from stalwart.runtime.comm._formation import Formation, form_group


class _Group:
    """A generation group whose builds fail while ``fail`` > 0."""

    def __init__(self, fail: int = 0, error: BaseException | None = None) -> None:
        self.fail, self.error, self.built = fail, error, []

    def build(self, generation: int) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise self.error or RuntimeError("a member never came")
        self.built.append(generation)


@pytest.fixture
def no_replicas(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """What form_group asked to check after each build (the default group and the
    replica comparison need a real group: tests/runtime/comm/test_world.py)."""
    seen: list[tuple[int, bool]] = []
    monkeypatch.setattr(
        _formation, "formed", lambda group, state, *, step, fresh: seen.append((step, fresh))
    )
    return seen


def _coord() -> Coordinator:
    return Coordinator(MemoryStore(), CoordinatorConfig(job_id="j"))


def test_a_formation_is_frozen_and_knows_a_fresh_start() -> None:
    f = Formation(3, 1, 4, 120, "memory", lost=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.rank = 0  # type: ignore[misc]
    assert not f.fresh and Formation(0, 0, 1, 0, "none").fresh


def test_form_group_builds_then_checks_the_replicas(no_replicas: list[Any]) -> None:
    group, coord = _Group(), _coord()
    assert form_group(group, coord, 0, {}, step=7, fresh=False)
    assert group.built == [0] and no_replicas == [(7, False)]
    assert coord.generation() == 0


def test_a_failed_build_ends_the_generation_once(no_replicas: list[Any]) -> None:
    group, coord = _Group(fail=1), _coord()
    assert not form_group(group, coord, 0, {}, step=0, fresh=True)
    assert coord.generation() == 1 and no_replicas == []
    # a member that fails at an old generation does not end the new one
    group.fail = 1
    assert not form_group(group, coord, 0, {}, step=0, fresh=True)
    assert coord.generation() == 1


def test_diverged_replicas_are_raised_not_retried(no_replicas: list[Any]) -> None:
    group, coord = _Group(fail=1, error=ReplicaMismatchError("differ")), _coord()
    with pytest.raises(ReplicaMismatchError):
        form_group(group, coord, 0, {}, step=0, fresh=True)
    assert coord.generation() == 0


def test_the_session_is_the_only_writer_of_where_it_stands(
    tmp_path: Path, shm_namespace: str
) -> None:
    from stalwart.contract.env import WorkerEnv
    from stalwart.runtime import Session

    env = dataclasses.replace(WorkerEnv.from_environ({}), run_dir=str(tmp_path), job=shm_namespace)
    sess = Session(env)
    try:
        for name in ("rank", "world_size", "generation", "step"):
            with pytest.raises(AttributeError):
                setattr(sess, name, 5)
        model = torch.nn.Linear(2, 2)
        sess.track(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        seen = [(step, sess.step) for step in sess.steps(3)]
        assert seen == [(1, 0), (2, 1), (3, 2)]
        assert (sess.step, sess.generation, sess.rank, sess.world_size) == (3, 0, 0, 1)
    finally:
        sess.close()
