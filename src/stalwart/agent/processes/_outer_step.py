"""One training step per outermost ``optimizer.step()``, however the optimizers nest.

Why: an optimizer container is itself an ``Optimizer`` whose ``step()`` steps the
optimizers it holds (torchtitan's ``OptimizersContainer`` over one AdamW per model part).
torch runs the global step hooks for the container's ``step()`` and again for each inner
one, so counting hook calls counted a 30-step run as 60 (and ``at=step:N`` chaos fired at
step N/2). A step is counted when the outermost ``step()`` in progress on its thread
returns; the inner ones it runs are part of it. Two optimizers stepped one after the other
(a GAN's generator and discriminator) are two steps, as before: nothing tells them from a
loop that steps one optimizer twice.

A step DCP takes to create an optimizer's state (``_init_optim_state``: zero gradients,
lr 0, run by ``get_optimizer_state_dict``/``set_optimizer_state_dict`` on an optimizer
without state, as a script's own save or resume does) is no training step: not counted.

A ``step()`` that raised never runs its post hook; its entry is dropped when the same
optimizer steps again (no optimizer steps inside its own ``step()``), so an exception
leaves no step uncounted after it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from stalwart.compat.torch_optim import DCP_INIT_OPTIM_STATE

__all__ = ["OuterSteps"]


class OuterSteps:
    """The global optimizer step hooks of a plain script's worker (agent/processes/observe.py):
    ``before()`` runs before an outermost ``step()``, ``after()`` once it returned, and
    ``each(opt)`` (if given) before every ``step()``, nested ones included."""

    def __init__(
        self,
        before: Callable[[], None],
        after: Callable[[], None],
        each: Callable[[Any], None] | None = None,
    ) -> None:
        self._before, self._after, self._each = before, after, each
        self._local = threading.local()  # .stack: the optimizers stepping on this thread

    def _stack(self) -> list[Any]:
        stack: list[Any] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre(self, opt: Any, *_: Any) -> None:
        if _in_lazy_init():
            return
        stack = self._stack()
        for i, o in enumerate(stack):
            if o is opt:  # its last step() raised: what ran inside it is over too
                del stack[i:]
                break
        outermost = not stack
        stack.append(opt)
        if self._each is not None:
            self._each(opt)
        if outermost:
            self._before()

    def post(self, opt: Any, *_: Any) -> None:
        if _in_lazy_init():
            return
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is opt:
                del stack[i:]
                break
        else:
            if stack:
                return  # not one this thread saw begin, inside another's step()
        if not stack:
            self._after()

    def install(self) -> Callable[[], None]:
        """Register both hooks for every optimizer; returns what removes them."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        handles = [
            register_optimizer_step_pre_hook(self.pre),
            register_optimizer_step_post_hook(self.post),
        ]

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove


_LAZY_INIT = DCP_INIT_OPTIM_STATE  # torch.distributed.checkpoint.state_dict's
_FRAMES = 6  # a hook, torch's step wrapper, maybe an LR scheduler's and a guard's, DCP


def _in_lazy_init() -> bool:
    """Whether this step hook runs inside DCP's lazy optimizer initialisation."""
    frame: FrameType | None = sys._getframe(2)  # the caller of the hook's caller (pre/post)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_code.co_name == _LAZY_INIT and "checkpoint" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False
