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


def test_reopening_mid_epoch_draws_nothing_from_the_global_rng(accelerator_state: Any) -> None:
    _, dl = _prepared()
    batches = StepBatches(dl)
    batches(1)
    torch.manual_seed(5)
    batches(3)  # reopened, skipping: the epoch's opening draws are in the restored RNGs
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), after)


def test_the_global_rng_stream_is_the_plain_loops(accelerator_state: Any) -> None:
    """The port is bit-equal to the script it came from: a plain ``for batch in dl`` loop
    and the ported one draw the same numbers (a dropout mask per step) across epochs."""
    _, dl = _prepared(seedable=True)

    def plain() -> list[float]:
        torch.manual_seed(7)
        drawn = []
        for epoch in range(3):
            dl.set_epoch(epoch)
            for _ in dl:
                drawn.append(torch.rand(1).item())
        return drawn

    expected = plain()
    torch.manual_seed(7)
    batches = StepBatches(dl)
    ported = []
    for step in range(1, 16):
        batches(step)
        ported.append(torch.rand(1).item())
    assert ported == expected


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


# ------------------------------------------------------------ gradient accumulation
def _accumulating(sess: Any, k: int, total: int = 18) -> list[torch.Tensor]:
    """A loop under ``accelerator.accumulate(model)`` (a step per micro-batch, the
    optimizer stepping every ``k``), 12 batches an epoch, dropout on; ``sess`` None: the
    plain loop."""
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    config = accelerate.DataLoaderConfiguration(use_seedable_sampler=True)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=k, dataloader_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g)
    )
    dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    if sess is not None:
        track(sess, accelerator=acc, model=model, optimizer=opt, lr_scheduler=sched)
    batch_for = StepBatches(dl)
    for step in sess.steps(total) if sess is not None else range(1, total + 1):
        x, y = batch_for(step)
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("k", [2, 3])
def test_a_failure_at_every_position_of_an_accumulation_cycle_finishes_bit_identical(
    accelerator_state: Any, k: int
) -> None:
    """The step that fails is each micro-batch of a cycle in turn (and the cycle's last,
    whose optimizer step is undone too): the rollback lands at the end of the cycle
    before it, never inside one, and the run ends as the fault-free one."""
    from ._fake import FakeSession, same_params

    plain = _accumulating(None, k)
    start = 2 * k  # a cycle inside the first epoch, the one ending it (12), the next
    for base in (start, 12 - k, 12):
        for failing in range(base + 1, base + k + 1):
            sess = FakeSession(fail_at={failing: base})
            assert same_params(_accumulating(sess, k), plain), f"step {failing} failed"
            assert sess.generation == 1 and sorted(sess.snapshots) == list(range(0, 19, k))
    # twice in a row, the second inside the redone cycle
    sess = FakeSession(fail_at={start + 1: start, start + k - 1 + 1: start})
    assert same_params(_accumulating(sess, k), plain)


def test_accumulation_without_the_accelerator_is_refused_with_the_call_to_write(
    accelerator_state: Any,
) -> None:
    from ._fake import FakeSession

    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="accelerator=accelerator, model=model"):
        track(FakeSession(), model=model, optimizer=opt)  # type: ignore[arg-type]


def test_epochs_that_are_not_whole_cycles_are_refused_with_the_fix(
    accelerator_state: Any,
) -> None:
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    ds = torch.utils.data.TensorDataset(torch.arange(20))
    dl = acc.prepare(torch.utils.data.DataLoader(ds, batch_size=4))  # 5 batches
    with pytest.raises(ConfigError, match="sync_with_dataloader=False"):
        StepBatches(dl)
