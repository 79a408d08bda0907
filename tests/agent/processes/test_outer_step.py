"""A plain script's steps: one per outermost optimizer.step(), however optimizers nest."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stalwart.agent.processes._outer_step import OuterSteps


class _Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer in short: an Optimizer stepping its optimizers."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=0.1) for p in parts]
        torch.optim.Optimizer.__init__(self, [p for m in parts for p in m.parameters()], {})

    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for opt in self.optimizers:
            opt.step(*args, **kwargs)


class _Count:
    def __init__(self) -> None:
        self.before = self.after = 0
        self.steps = OuterSteps(self._before, self._after)

    def _before(self) -> None:
        assert self.before == self.after  # never twice before one step ends
        self.before += 1

    def _after(self) -> None:
        self.after += 1


@pytest.fixture
def count() -> Any:
    c = _Count()
    remove = c.steps.install()
    yield c
    remove()


def _backward(*modules: torch.nn.Module) -> None:
    for m in modules:
        m(torch.ones(1, 2)).sum().backward()


def test_a_containers_step_and_its_optimizers_steps_are_one_step(count: _Count) -> None:
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]
    opt = _Container(parts)
    for _ in range(30):
        _backward(parts[0])
        opt.step()
    assert (count.before, count.after) == (30, 30)  # not 90: 30 container + 2 x 30 inner


def test_optimizers_stepped_one_after_the_other_are_each_a_step(count: _Count) -> None:
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    _backward(a, b)
    opt_a.step()
    opt_b.step()
    assert count.after == 2


def test_a_step_that_raised_leaves_no_later_step_uncounted(count: _Count) -> None:
    parts = [torch.nn.Linear(2, 1)]
    opt = _Container(parts)

    def boom(*_: Any) -> None:
        raise RuntimeError("inner step failed")

    handle = opt.optimizers[0].register_step_pre_hook(boom)
    with pytest.raises(RuntimeError):
        opt.step()
    handle.remove()
    count.before = count.after  # the failed step began and never ended
    _backward(parts[0])
    opt.step()
    opt.step()
    assert count.after == 2
