"""Looking never changes the result: a snapshot (or a restore of one taken before the
first step) leaves an optimizer with the state it had, none included, so that a run with
stalwart's snapshots computes the same losses, bit for bit, as the same run without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _titan import inner_states, make_titan, titan_step

from stalwart.checkpoint import SnapshotConfig, Snapshotter, load_state_of, state_dict_of
from stalwart.runtime.integrity._digest import replicated_tensors, state_digest

STEPS = 6


def _plain_losses(flatten: bool = True) -> list[float]:
    state = make_titan(flatten=flatten)
    return [titan_step(state) for _ in range(STEPS)]


@pytest.fixture
def snap(shm_namespace: str) -> Any:
    s = Snapshotter(SnapshotConfig(shm_namespace))
    yield s
    s.close(unlink=True)


def test_dcp_state_dict_of_an_optimizer_without_state_creates_none() -> None:
    """The bug this guards against: DCP's get_optimizer_state_dict steps a stateless
    optimizer once (AdamW's step reads 1 before the first real step)."""
    state = make_titan()
    assert state["optimizer"].state_dict()["state.embed.weight.step"] == 1  # DCP itself does
    state = make_titan()
    sd = state_dict_of(state["optimizer"])
    assert inner_states(state) == [{}, {}]
    assert not any(k.startswith("state.") for k in sd)
    assert sd["param_groups.embed.weight.lr"] == pytest.approx(1e-2 / 3)
    assert all(p.grad is None for p in state["model"].parameters())


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_snapshots_at_every_step_leave_the_losses_bit_identical(
    snap: Snapshotter, flatten: bool, blocking: bool
) -> None:
    state = make_titan(flatten=flatten)
    for opt in state["optimizer"].optimizers:
        snap.guard(opt)  # a background copy is waited for before the state changes
    losses = []
    snap.snapshot(state, 0, blocking=blocking)  # the step-0 snapshot of sess.steps()
    for step in range(1, STEPS + 1):
        losses.append(titan_step(state))
        snap.snapshot(state, step, blocking=blocking)
    snap.wait()
    assert losses == _plain_losses(flatten)


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "nested"])
def test_a_rollback_to_the_snapshot_before_the_first_step_restores_no_state(
    snap: Snapshotter, flatten: bool
) -> None:
    state = make_titan(flatten=flatten)
    snap.snapshot(state, 0)
    for _ in range(3):
        titan_step(state)
    snap.snapshot(state, 3)
    assert snap.restore(state, step=0) == 0
    assert inner_states(state) == [{}, {}]  # "no state yet", as before the first step
    assert [titan_step(state) for _ in range(STEPS)] == _plain_losses(flatten)


def test_a_fresh_process_restores_no_state_then_a_later_step_exactly(snap: Snapshotter) -> None:
    """A replacement worker: fresh objects, restored from the slots of the one it replaces."""
    state = make_titan()
    snap.snapshot(state, 0)
    losses = [titan_step(state) for _ in range(3)]
    snap.snapshot(state, 3)
    fresh = make_titan(seed=1)
    assert snap.restore(fresh, step=0) == 0
    assert inner_states(fresh) == [{}, {}]
    assert [titan_step(fresh) for _ in range(3)] == losses
    fresh = make_titan(seed=1)
    assert snap.restore(fresh, step=3) == 3
    steps = [float(s["step"]) for st in inner_states(fresh) for s in st.values()]
    assert steps and all(s == 3.0 for s in steps)
    assert [titan_step(fresh) for _ in range(STEPS - 3)] == _plain_losses()[3:]


def test_get_state_dict_app_state_snapshots_and_restores_no_state(snap: Snapshotter) -> None:
    """DCP's tutorial style: an app state whose state_dict() is get_state_dict(model, optim)
    (and get_model_state_dict, which touches no optimizer)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    class AppState:
        def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            self.model, self.opt = model, opt

        def state_dict(self) -> dict[str, Any]:
            model_sd, optim_sd = get_state_dict(self.model, self.opt)
            return {"model": model_sd, "optim": optim_sd}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            set_state_dict(
                self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
            )

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    app = {"app": AppState(model, opt), "model_only": _ModelOnly(model, get_model_state_dict)}
    snap.snapshot(app, 0)
    assert not opt.state
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    snap.restore(app, step=0)
    assert not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _ModelOnly:
    def __init__(self, model: torch.nn.Module, get: Any) -> None:
        self.model, self.get = model, get

    def state_dict(self) -> dict[str, Any]:
        return dict(self.get(self.model))

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd)


def test_another_lazy_initialisation_is_undone_and_named(caplog: pytest.LogCaptureFixture) -> None:
    """A state_dict() that steps its optimizer some other way than DCP's."""

    class Eager:
        def __init__(self) -> None:
            self.param = torch.nn.Parameter(torch.ones(3))
            self.opt = torch.optim.Adam([self.param], lr=0.5)

        def state_dict(self) -> dict[str, Any]:
            if not self.opt.state:
                self.opt.param_groups[0]["lr"] = 0.0
                self.param.grad = torch.zeros(3)
                self.opt.step()
                self.opt.param_groups[0]["lr"] = 0.5
                self.param.grad = None
            return self.opt.state_dict()

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.opt.load_state_dict(sd)

    eager = Eager()
    state_dict_of(eager, "eager")
    assert not eager.opt.state
    assert torch.equal(eager.param.detach(), torch.ones(3))
    assert "'eager' stepped an optimizer" in caplog.text


def test_loading_a_state_without_optimizer_state_empties_the_optimizer() -> None:
    state = make_titan()
    empty = state_dict_of(state["optimizer"])
    titan_step(state)
    load_state_of(state["optimizer"], empty)
    assert inner_states(state) == [{}, {}]


def test_digests_create_no_state() -> None:
    state = make_titan()
    opt = torch.optim.AdamW(state["model"].parameters())
    state_digest(replicated_tensors({"optimizer": opt, "titan": state["optimizer"]}))
    assert not opt.state and inner_states(state) == [{}, {}]


def test_a_fresh_fsdp2_container_restores_dtensor_moments(snap: Snapshotter) -> None:
    """FSDP2 parameters behind a DCP container: a replacement's container (no state) gets
    its moments back as DTensors of its parameters' mesh, and before the first step none."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from stalwart.runtime.comm.group import ensure_local_default_group

    ensure_local_default_group()
    import torch.distributed as dist

    def build() -> dict[str, Any]:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # type: ignore[arg-type]
        return make_titan(shard=lambda layer: fully_shard(layer, mesh=mesh))

    state = build()
    snap.snapshot(state, 0)
    losses = [titan_step(state) for _ in range(2)]
    snap.snapshot(state, 2)
    losses += [titan_step(state) for _ in range(2)]
    fresh = build()
    assert snap.restore(fresh, step=2) == 2
    moments = [v for st in inner_states(fresh) for s in st.values() for v in s.values()]
    assert any(isinstance(v, DTensor) for v in moments)
    assert [titan_step(fresh) for _ in range(2)] == losses[2:]
    fresh = build()
    assert snap.restore(fresh, step=0) == 0
    assert inner_states(fresh) == [{}, {}]
    assert [titan_step(fresh) for _ in range(4)] == losses
