"""Live rollback: undo a failed step in memory, without reading a snapshot.

A failed step changes less than it seems: its optimizer step is skipped (the session
guards ``optimizer.step``), so parameters and optimizer state are still those of the last
completed step. What did move is small: the loader's position, the RNG states, module
buffers (e.g. BatchNorm statistics updated by the forward pass), the LR schedulers'
counters and the hyperparameters they (or the script) set in the optimizers' param
groups. :class:`LiveRollback` captures exactly those at the start of every
step (tens of microseconds for the demo's model) and puts them back after a failure, so
that elastic survivors resume from the last step every member completed instead of the
newest snapshot (which the snapshot cadence may have left many steps behind).

It refuses (``capable`` False, with a reason) when the tracked state holds something it
cannot vouch for: a plain tensor over 1 MiB (it could be changed in place by the step),
or module buffers over 64 MiB in all (too costly to copy every step). Then survivors
roll back to the newest common snapshot as before.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from stalwart.checkpoint import load_state_of, state_dict_of

__all__ = ["LiveRollback"]

_MAX_TENSOR = 1 << 20
_MAX_BUFFERS = 64 << 20


def _hyperparams(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings (lr, momentum, betas, ...), without the parameters."""
    return [
        {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in g.items()
            if k != "params"
        }
        for g in opt.param_groups
    ]


def _put_hyperparams(opt: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    for g, values in zip(opt.param_groups, saved, strict=True):
        for k, v in values.items():
            if isinstance(g.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                g[k].copy_(v)  # a tensor LR (capturable): schedulers fill it in place
            else:
                g[k] = v


class LiveRollback:
    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state
        self.capable, self.reason = True, ""
        buffers = 0
        for name, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                buffers += sum(b.numel() * b.element_size() for b in obj.buffers())
            elif isinstance(obj, torch.Tensor) and obj.numel() * obj.element_size() > _MAX_TENSOR:
                self.capable, self.reason = False, f"tracked tensor {name!r} is over 1 MiB"
        if buffers > _MAX_BUFFERS:
            self.capable, self.reason = False, "module buffers are over 64 MiB"
        self._saved: tuple[int, list[tuple[Any, Any]]] | None = None

    def capture(self, step: int) -> None:
        """Before step ``step + 1``: what a failure of it would have to undo."""
        if not self.capable:
            return
        saved: list[tuple[Any, Any]] = []
        for obj in self.state.values():
            if isinstance(obj, torch.optim.Optimizer):
                # guarded: a failed step leaves its state alone, but a scheduler's step
                # (or the script) may set its param groups' lr
                saved.append((obj, _hyperparams(obj)))
            elif isinstance(obj, torch.nn.Module):
                saved += [(b, b.detach().clone()) for b in obj.buffers()]
            elif isinstance(obj, torch.Tensor):
                saved.append((obj, obj.detach().clone()))
            elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                # taken without creating optimizer state (a container of DCP optimizers)
                saved.append((obj, copy.deepcopy(state_dict_of(obj))))
            elif isinstance(obj, dict):  # tracked Python values
                saved.append((obj, copy.deepcopy(obj)))
        self._saved = (step, saved)

    def rollback(self, step: int) -> bool:
        """After a failed step ``step + 1``: restore what it changed; False if that is not
        possible (nothing captured for it)."""
        if self._saved is None or self._saved[0] != step:
            return False
        for obj, value in self._saved[1]:
            if isinstance(obj, torch.optim.Optimizer):
                _put_hyperparams(obj, value)
            elif isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(value)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(value)
            else:
                load_state_of(obj, value)
        self._saved = None
        return True
