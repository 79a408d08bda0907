"""A torchtitan-like training state: optimizer and LR scheduler containers over model parts.

As torchtitan's ``OptimizersContainer`` (v0.2.2): an ``Optimizer`` subclass holding one
optimizer per model part, whose ``state_dict()`` is DCP's ``get_optimizer_state_dict``
(flattened by default) of every part merged, and whose ``step()``/``zero_grad()`` run over
the parts' optimizers. DCP's ``get_optimizer_state_dict`` initialises an optimizer with no
state by a zero-gradient step: what a snapshot before the first step must not do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from stalwart.checkpoint import RNGState


class OptimizersContainer(torch.optim.Optimizer):
    def __init__(self, parts: list[torch.nn.Module], flatten: bool = True, **kw: Any) -> None:
        self.model_parts = parts
        self.optimizers = [torch.optim.AdamW(p.parameters(), **kw) for p in parts]
        self.options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        params = [p for m in parts for p in m.parameters()]
        torch.optim.Optimizer.__init__(self, params, kw)  # hooks, as torchtitan does

    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for opt in self.optimizers:
            opt.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for opt in self.optimizers:
            opt.zero_grad(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        func = functools.partial(get_optimizer_state_dict, options=self.options)
        if not self.options.flatten_optimizer_state_dict:
            return {f"part{i}": func(m, o) for i, (m, o) in enumerate(self._pairs())}
        return {k: v for sd in (func(m, o) for m, o in self._pairs()) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, (m, o) in enumerate(self._pairs()):
            sd = state_dict if self.options.flatten_optimizer_state_dict else state_dict[f"part{i}"]
            set_optimizer_state_dict(m, o, optim_state_dict=sd, options=self.options)

    def _pairs(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
        return list(zip(self.model_parts, self.optimizers, strict=True))


class SchedulersContainer:
    """One LambdaLR per optimizer of the container (torchtitan's LRSchedulersContainer)."""

    def __init__(self, optimizers: OptimizersContainer, warmup: int = 3) -> None:
        def lr_at(step: int) -> float:
            return min(1.0, (step + 1) / warmup)

        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lr_at) for o in optimizers.optimizers
        ]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()  # all alike, as torchtitan keeps one

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.load_state_dict(dict(sd))


def make_titan(
    seed: int = 0, flatten: bool = True, shard: Callable[[torch.nn.Module], Any] | None = None
) -> dict[str, Any]:
    """Two model parts (distinct parameter names, as pipeline stages have), an AdamW
    container with weight decay and a warm-up schedule; the batches come from the RNG.
    ``shard`` (e.g. FSDP2's ``fully_shard``) is applied to every layer before the
    optimizers are built, as torchtitan parallelises before it builds them."""
    torch.manual_seed(seed)
    first = torch.nn.ModuleDict({"embed": torch.nn.Linear(8, 16)})
    second = torch.nn.ModuleDict({"head": torch.nn.Linear(16, 1)})
    for layer in (first["embed"], second["head"]) if shard is not None else ():
        shard(layer)
    opt = OptimizersContainer([first, second], flatten=flatten, lr=1e-2, weight_decay=0.1)
    return {
        "model": torch.nn.ModuleList([first, second]),
        "optimizer": opt,
        "lr_scheduler": SchedulersContainer(opt),
        "rng": RNGState(),
    }


def titan_step(state: dict[str, Any]) -> float:
    """One training step; returns the loss (as a float: compared bit for bit)."""
    first, second = state["model"]
    x = torch.randn(4, 8)
    loss = second["head"](torch.tanh(first["embed"](x))).square().mean()
    loss.backward()
    state["optimizer"].step()
    state["lr_scheduler"].step()
    state["optimizer"].zero_grad()
    return float(loss.item())


def inner_states(state: dict[str, Any]) -> list[dict[Any, Any]]:
    return [dict(o.state) for o in state["optimizer"].optimizers]
