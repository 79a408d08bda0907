"""integrations/accelerate.py in one process: what a loop over ``Accelerator.prepare``
needs from stalwart (the batch of a step, the torch objects inside Accelerate's wrappers).

The multi-process runs (a kill, a hang, a long eval) are cells of
tests/corpus/test_matrix.py (examples/corpus/accelerate_loop.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="the [hf] extra is not installed")

from stalwart.errors import ConfigError  # noqa: E402
from stalwart.integrations.accelerate import StepBatches, track  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _prepared(seedable: bool = True) -> Any:
    config = accelerate.DataLoaderConfiguration(use_seedable_sampler=seedable)
    acc = accelerate.Accelerator(cpu=True, dataloader_config=config)
    ds = torch.utils.data.TensorDataset(torch.arange(20))
    return acc, acc.prepare(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True))


@pytest.fixture
def accelerator_state() -> Any:
    yield
    accelerate.state.AcceleratorState._reset_state(True)  # the next test builds its own


def _epochs(dl: Any, n: int) -> list[list[int]]:
    """What a plain loop over ``n`` epochs reads, batch by batch."""
    out: list[list[int]] = []
    for epoch in range(n):
        dl.set_epoch(epoch)
        out += [b[0].tolist() for b in dl]
    return out


def test_the_batch_of_a_step_after_a_rollback_or_a_resume_is_the_fault_free_one(
    accelerator_state: Any,
) -> None:
    _, dl = _prepared()
    expected = _epochs(dl, 3)  # 5 batches an epoch
    batches = StepBatches(dl)
    assert [batches(s)[0].tolist() for s in range(1, 9)] == expected[:8]
    # a rollback to step 3 (back across the epoch boundary), then on
    assert [batches(s)[0].tolist() for s in range(4, 16)] == expected[3:15]
    # a replaced rank: a new process resumes at step 12
    assert StepBatches(dl)(12)[0].tolist() == expected[11]


def test_opening_the_iterator_draws_nothing_from_the_global_rng(accelerator_state: Any) -> None:
    _, dl = _prepared()
    batches = StepBatches(dl)
    torch.manual_seed(5)
    batches(1)
    batches(3)  # reopened, skipping
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), after)


def test_a_sampler_that_depends_on_the_epochs_iterated_is_refused(accelerator_state: Any) -> None:
    _, dl = _prepared(seedable=False)
    with pytest.raises(ConfigError, match="use_seedable_sampler=True"):
        StepBatches(dl)


class _Tracks:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def track(self, **state: Any) -> dict[str, Any]:
        self.state = state
        return state


def test_track_takes_the_torch_objects_out_of_accelerates_wrappers(
    accelerator_state: Any,
) -> None:
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, p_opt, p_sched = acc.prepare(model, opt, sched)
    assert p_opt is not opt and p_sched is not sched
    sess = _Tracks()
    track(sess, model=model, optimizer=p_opt, lr_scheduler=p_sched, meta={"x": 1})  # type: ignore[arg-type]
    assert sess.state["optimizer"] is opt and sess.state["lr_scheduler"] is sched
    assert sess.state["model"] is model and sess.state["meta"] == {"x": 1}
