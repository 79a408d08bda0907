"""Flatten a training state into tensors plus a JSON tree, and back.

Why a tagged JSON tree instead of pickle: a checkpoint is read by other processes
(the agent, a peer node, a restore on another machine). Unpickling runs arbitrary code,
so nothing in the format is pickled. Every container is a tagged object so that the
tree round-trips exactly (tuples stay tuples, int dict keys stay ints, NaN stays NaN);
tensors and numpy arrays become references into the tensor table.

Encoding (``t`` is the tag):

- ``null``/``true``/``false``/numbers/strings: themselves
  (non-finite floats: ``{"t":"float","v":"nan"}``)
- ``{"t":"dict","items":[[key, value], ...]}`` (keys encoded like values)
- ``{"t":"list","items":[...]}``, ``{"t":"tuple","items":[...]}``
- ``{"t":"tensor","id":N}``, ``{"t":"ndarray","id":N}``
- ``{"t":"bytes","b64":"..."}``, ``{"t":"dtype","v":"float32"}``
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.errors import UnsupportedStateError

__all__ = ["Leaf", "flatten", "unflatten"]

JSON = Any  # the encoded tree: nested dict/list/str/int/float/bool/None

# Leaves that encode as themselves (floats are not here: NaN/inf need a tag).
_PLAIN = frozenset({int, str, bool, type(None)})


@dataclass
class Leaf:
    """One array leaf of the state: its path (for messages) and the tensor itself."""

    path: str
    tensor: torch.Tensor
    is_ndarray: bool = False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten(state: Any) -> tuple[JSON, list[Leaf]]:
    """Encode ``state`` as a JSON tree; tensors are collected in order into ``leaves``."""
    leaves: list[Leaf] = []

    def enc(obj: Any, path: str) -> JSON:
        if obj is None or isinstance(obj, bool | str):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            if math.isfinite(obj):
                return obj
            return {"t": "float", "v": repr(obj)}
        if isinstance(obj, torch.Tensor):
            leaves.append(Leaf(path, obj))
            return {"t": "tensor", "id": len(leaves) - 1}
        if isinstance(obj, dict):
            return {
                "t": "dict",
                "items": [[enc(k, f"{path}.<key>"), enc(v, f"{path}.{k}")] for k, v in obj.items()],
            }
        if isinstance(obj, list | tuple):
            tag = "list" if isinstance(obj, list) else "tuple"
            if all(type(v) in _PLAIN for v in obj):  # e.g. Python's 625-int RNG state
                return {"t": tag, "items": list(obj)}
            return {"t": tag, "items": [enc(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, bytes | bytearray):
            return {"t": "bytes", "b64": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": _dtype_name(obj)}
        np_array = _as_ndarray(obj)
        if np_array is not None:
            leaves.append(Leaf(path, np_array, is_ndarray=True))
            return {"t": "ndarray", "id": len(leaves) - 1}
        if _is_numpy_scalar(obj):
            return enc(obj.item(), path)
        raise UnsupportedStateError(
            f"cannot checkpoint {path or '<root>'} of type {type(obj).__name__}: only tensors, "
            "numpy arrays, dict/list/tuple, str, int, float, bool, bytes and None are stored "
            "(no pickle); convert it in your state_dict() or leave it out of the tracked state"
        )

    tree = enc(state, "")
    return tree, leaves


def _as_ndarray(obj: Any) -> torch.Tensor | None:
    mod = type(obj).__module__
    if mod == "numpy" and type(obj).__name__ == "ndarray":
        return torch.from_numpy(obj)
    return None


def _is_numpy_scalar(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "item") and hasattr(obj, "dtype")


def unflatten(tree: JSON, tensor_of: Callable[[int, bool], Any]) -> Any:
    """Decode a tree made by :func:`flatten`; ``tensor_of(id, is_ndarray)`` supplies leaves."""

    def dec(node: JSON) -> Any:
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if not isinstance(node, dict) or "t" not in node:
            raise ValueError(f"malformed tree node: {str(node)[:80]}")
        tag = node["t"]
        if tag == "dict":
            return {_hashable(dec(k)): dec(v) for k, v in node["items"]}
        if tag == "list":
            return [dec(v) for v in node["items"]]
        if tag == "tuple":
            return tuple(dec(v) for v in node["items"])
        if tag == "tensor":
            return tensor_of(int(node["id"]), False)
        if tag == "ndarray":
            return tensor_of(int(node["id"]), True)
        if tag == "float":
            return float(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["b64"])
        if tag == "dtype":
            return getattr(torch, str(node["v"]))
        raise ValueError(f"unknown tree tag {tag!r}")

    return dec(tree)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
