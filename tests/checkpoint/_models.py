"""Small deterministic training states shared by the checkpoint tests."""

from __future__ import annotations

from typing import Any

import torch

from stalwart.checkpoint import RNGState


def make_state(seed: int = 0, frozen: bool = False) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    if frozen:
        for p in model[0].parameters():
            p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": RNGState(),
        "extra": {"epoch": 1, "pair": (1, 2.5), "name": "run"},
    }


def train_step(state: dict[str, Any]) -> None:
    model, opt = state["model"], state["optimizer"]
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state["scheduler"].step()


def params(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    opt = state["optimizer"]
    plist = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(plist):
        for k, v in opt.state.get(p, {}).items():
            out[f"opt.{i}.{k}"] = v.clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
