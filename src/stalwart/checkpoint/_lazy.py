"""Looking never changes the result: taking or loading a state dict creates no optimizer state.

Why this exists: ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (and
``get_state_dict``, ``set_optimizer_state_dict``) begin with ``_init_optim_state``: an
optimizer that has no state yet is stepped once with zero gradients and lr 0, so that its
state dict has tensors to show. Adam's ``step`` then reads 1 before the first real step, its
bias correction is shifted by one, and the run departs from the same script run without
stalwart from its second step on. An optimizer container whose ``state_dict()`` returns DCP
state dicts (torchtitan's ``OptimizersContainer``) does that on every snapshot taken before
its first step.

While stalwart takes a state dict (:func:`looking`), DCP's lazy initialisation is skipped:
an optimizer with no state is shown with none (its param groups only), as torch's own
``Optimizer.state_dict`` shows it. Any other optimizer step during the look (another
library's lazy initialisation) is watched for: the state it created in an optimizer that
had none is removed again, its param groups' values are put back as they were when it
stepped, and a warning names it: the snapshot itself holds that state.

While stalwart loads a state dict that holds no optimizer state (a snapshot taken before
the first step) into a tracked object (:func:`loading`), DCP's initialisation is skipped
too and the optimizers it loads are left with no state: restoring such a snapshot restores
"no state yet". Without this, DCP would create state and fill it with placeholders (the
flattened format) or refuse (the nested one).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from stalwart.compat.torch_optim import DCP_INIT_OPTIM_STATE, DCP_STATE_DICT
from stalwart.logs import get_logger

__all__ = [
    "holds_no_optimizer_state",
    "load_state_of",
    "loading",
    "looking",
    "state_dict_of",
]

_log = get_logger(__name__)
_DCP = DCP_STATE_DICT
_INIT = DCP_INIT_OPTIM_STATE
_lock = threading.Lock()
_depth = 0  # looks/loads in progress on any thread (a load takes a look for its targets)
_original: Callable[[torch.optim.Optimizer], None] | None = None
_local = threading.local()  # .cleared: the optimizers a load on this thread emptied
_warned: set[str] = set()


def _skip_init(optim: torch.optim.Optimizer) -> None:
    """DCP's ``_init_optim_state`` while stalwart looks or loads: an optimizer with no state
    keeps none (one with state is left as it is, as DCP's own function leaves it). In a
    load of a state that holds none (:func:`loading`) the optimizer's state is emptied
    first: DCP loads only the keys the optimizer's state already has."""
    cleared: list[torch.optim.Optimizer] | None = getattr(_local, "cleared", None)
    if cleared is not None:
        optim.state.clear()
        cleared.append(optim)


@contextlib.contextmanager
def _dcp_init_skipped() -> Iterator[None]:
    """DCP's lazy optimizer initialisation replaced by :func:`_skip_init` (the module is
    patched only when the script imported it: a script without DCP pays nothing)."""
    global _depth, _original
    with _lock:
        module = sys.modules.get(_DCP)
        if _depth == 0 and module is not None and hasattr(module, _INIT):
            _original = getattr(module, _INIT)
            setattr(module, _INIT, _skip_init)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _original is not None:
                setattr(sys.modules[_DCP], _INIT, _original)
                _original = None


class _StepWatch:
    """Optimizer steps taken on this thread while it looks (a lazy initialisation that is
    not DCP's); undoes what they created in optimizers that had no state."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.seen: list[tuple[torch.optim.Optimizer, list[dict[str, Any]]]] = []

    def pre(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() == self.thread and not opt.state:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            self.seen.append((opt, groups))

    def undo(self, what: str) -> None:
        for opt, groups in self.seen:
            opt.state.clear()
            for group, values in zip(opt.param_groups, groups, strict=False):
                group.update(values)
        if self.seen and what not in _warned:
            _warned.add(what)
            _log.warning(
                "taking the state of %r stepped an optimizer that had no state yet (lazy "
                "initialisation): the state it created was removed again so that training "
                "goes on as without stalwart, but this snapshot holds it; a restore of it "
                "before the first step starts from that state (initialise the optimizer's "
                "state before sess.steps() to make both the same)",
                what,
            )


@contextlib.contextmanager
def looking(what: str = "the tracked state") -> Iterator[None]:
    """Take state dicts inside this block without creating optimizer state."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    watch = _StepWatch()
    handle = register_optimizer_step_pre_hook(watch.pre)
    try:
        with _dcp_init_skipped():
            yield
    finally:
        handle.remove()
        watch.undo(what)


def state_dict_of(obj: Any, what: str = "the tracked state") -> Any:
    """``obj.state_dict()``, taken without creating optimizer state (see :func:`looking`)."""
    with looking(what):
        return obj.state_dict()


def load_state_of(obj: Any, value: Any) -> None:
    """``obj.load_state_dict(value)``; a ``value`` without optimizer state leaves the
    optimizers it loads into without state (see :func:`loading`)."""
    with loading(value):
        obj.load_state_dict(value)


def holds_no_optimizer_state(value: Any) -> bool:
    """True when ``value`` holds optimizer param groups and no optimizer state anywhere
    (within a few levels of mappings: an app state of ``{"model": ..., "optim": ...}``):
    torch's own ``{"state": {}, "param_groups": [...]}`` or DCP's flattened dict
    (``param_groups.*`` keys, no ``state.*`` key). A value with any optimizer state is
    loaded as it is: emptying an optimizer that it has state for would lose that state."""
    groups, state = _optimizer_parts(value, depth=3)
    return groups and not state


def _optimizer_parts(value: Any, depth: int) -> tuple[bool, bool]:
    """(whether ``value`` holds optimizer param groups, whether it holds optimizer state)."""
    if not isinstance(value, Mapping) or depth == 0:
        return False, False
    keys = [k for k in value if isinstance(k, str)]
    groups = "param_groups" in value or any(k.startswith("param_groups.") for k in keys)
    state = any(k.startswith("state.") for k in keys)
    if "param_groups" in value and isinstance(value.get("state"), Mapping):
        state = state or any(value["state"].values())
    for k, v in value.items():
        if k not in ("state", "param_groups"):
            g, s = _optimizer_parts(v, depth - 1)
            groups, state = groups or g, state or s
    return groups, state


@contextlib.contextmanager
def loading(value: Any) -> Iterator[None]:
    """Load ``value`` into a tracked object inside this block: when it holds no optimizer
    state, the optimizers DCP loads it into end with none (however much they had)."""
    if not holds_no_optimizer_state(value):
        yield
        return
    cleared: list[torch.optim.Optimizer] = []
    _local.cleared = cleared
    try:
        with looking("a loaded state"):
            yield
    finally:
        _local.cleared = None
        for opt in cleared:
            # the load put an empty state per parameter: "no state" is an empty mapping
            if not any(opt.state.values()):
                opt.state.clear()
