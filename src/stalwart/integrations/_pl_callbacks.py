"""The Lightning callbacks' state as JSON, rolled back with the step.

integrations/_pl_loop.py's ``LoopState`` says why: a callback's state decides which
collectives its hooks run (``ModelCheckpoint``'s saves), so every rank must hold the same
one after a rollback, the survivors and a replacement alike. What is kept per callback
(by its ``state_key``, as Lightning's own checkpoints key it): its ``state_dict()`` with
tensors written as ``{"__stalwart_tensor__": values, "dtype": name}``, and the few private
attributes by which ``ModelCheckpoint`` decides whether a step was already saved (they
are not in its ``state_dict``: Lightning resumes only at a saved step). A callback whose
state holds something JSON cannot hold is left as it is, and the log says so once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from stalwart.compat.lightning_trainer import MODEL_CHECKPOINT_PRIVATE
from stalwart.logs import get_logger

__all__ = ["callback_states", "load_callback_states"]

_log = get_logger(__name__)

# ModelCheckpoint (lightning 2.6): the step of its last save, a save deferred to the
# validation's end, the last file saved
_PRIVATE = MODEL_CHECKPOINT_PRIVATE
_TENSOR = "__stalwart_tensor__"
_warned: set[str] = set()


class _Unencodable(TypeError):
    pass


def callback_states(callbacks: Iterable[Any]) -> dict[str, Any]:
    """``{state_key: {"state": ..., "private": {...}}}`` of the callbacks that have any."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        key = str(getattr(cb, "state_key", type(cb).__qualname__))
        try:
            state = _encode(cb.state_dict())
        except _Unencodable as err:
            if key not in _warned:
                _warned.add(key)
                _log.warning("callback %s is not rolled back with the step: %s", key, err)
            continue
        private = {n: getattr(cb, n) for n in _PRIVATE if _scalar(getattr(cb, n, ()))}
        if state or private:
            out[key] = {"state": state, "private": private}
    return out


def load_callback_states(callbacks: Iterable[Any], states: dict[str, Any]) -> None:
    """Put back what :func:`callback_states` kept (a callback it did not keep is left)."""
    for cb in callbacks:
        entry = states.get(str(getattr(cb, "state_key", type(cb).__qualname__)))
        if not isinstance(entry, dict):
            continue
        state, private = entry.get("state"), entry.get("private")
        if not isinstance(state, dict) or not isinstance(private, dict):
            raise TypeError(f"tracked callback state {entry!r:.80} is not {{state, private}}")
        if state:
            cb.load_state_dict(_decode(state))
        for name, value in private.items():
            if name in _PRIVATE and hasattr(cb, name) and _scalar(value):
                setattr(cb, name, value)


def _scalar(v: Any) -> bool:
    return (
        v is None or isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v))
    )


def _encode(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return {_TENSOR: obj.detach().cpu().tolist(), "dtype": str(obj.dtype).split(".")[-1]}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise _Unencodable("a dict with keys that are not strings")
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_encode(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise _Unencodable(f"its state holds a {type(obj).__name__}")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            dtype = getattr(torch, str(obj.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"tracked callback state: {obj.get('dtype')!r} is no dtype")
            return torch.tensor(obj[_TENSOR], dtype=dtype)
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj
