"""A plain script's observer: its steps and the step it resumed at, on the progress board."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from stalwart.agent.processes._outer_step import OuterSteps
from stalwart.agent.processes.observe import _Observer
from stalwart.contract.board import ProgressBoard


@pytest.fixture
def observer(tmp_path: Path) -> Any:
    board = ProgressBoard(str(tmp_path / "board"), 1, create=True)
    obs = _Observer(board, 0)
    remove = OuterSteps(obs.before_step, obs.on_step, obs.each_step).install()
    yield obs
    remove()
    board.close(unlink=True)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_fresh_optimizer_says_nothing_of_a_resume(observer: Any) -> None:
    model = torch.nn.Linear(3, 1)
    _train(model, torch.optim.AdamW(model.parameters()), 4)
    slot = observer.board.read(0)
    assert (slot.step, slot.resumed, slot.observed) == (4, 0, True)


def test_a_script_that_loaded_its_optimizer_resumes_at_its_step_count(
    observer: Any, tmp_path: Path
) -> None:
    """As a script resuming from its own checkpoint: AdamW's step says where it was."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 7)  # the script's first process, up to its own checkpoint
    saved = get_optimizer_state_dict(model, opt)
    observer.step, observer.resumed = 0, None  # the restarted process starts afresh
    fresh = torch.optim.AdamW(model.parameters())
    set_optimizer_state_dict(model, fresh, saved)  # its lazy-init step is no step
    _train(model, fresh, 2)
    slot = observer.board.read(0)
    assert (slot.step, slot.resumed) == (9, 8)  # steps 8 and 9 of the script; after 7


def test_replicas_that_train_independently_are_said_so() -> None:
    """A Trainer or Accelerate script on CPU without --use_cpu forms no process group
    under torchrun: its workers train independent replicas, which the first step tells."""
    from stalwart.agent.processes.observe import independent_replicas

    line = independent_replicas(2, initialized=False, group_size=1)
    assert line is not None and "2 independent replicas" in line and "--use_cpu" in line
    assert "ACCELERATE_USE_CPU=1" in line
    partial = independent_replicas(4, initialized=True, group_size=1)
    assert partial is not None and "a process group of 1" in partial
    assert independent_replicas(2, initialized=True, group_size=2) is None
    assert independent_replicas(1, initialized=False, group_size=1) is None


def test_the_runtime_attaching_stops_the_plain_script_watcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stalwart.init() in a worker the zygote watched as a plain script stops the watcher
    through the board's hook (contract/board.py), without importing the agent: after it,
    the optimizer's steps no longer reach the board."""
    from stalwart.agent.processes import observe
    from stalwart.contract.board import runtime_attaches

    monkeypatch.delenv("STALWART_CONTRACT", raising=False)
    board = ProgressBoard(str(tmp_path / "board"), 1, create=True)
    try:
        observe.install(board.path, 0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, opt, 2)
        assert board.read(0).step == 2 and board.read(0).observed
        runtime_attaches()
        assert not observe.watching()
        _train(model, opt, 3)
        assert board.read(0).step == 2  # the watcher's hooks are gone
        runtime_attaches()  # once only: nothing left to run
    finally:
        observe.detach()
        board.close(unlink=True)
