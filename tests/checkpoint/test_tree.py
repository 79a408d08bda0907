from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from stalwart.checkpoint._tree import flatten, unflatten
from stalwart.errors import UnsupportedStateError


def test_round_trip_keeps_types_exactly() -> None:
    state = {
        "a": [1, 2.5, "x", None, True],
        "t": (1, (2, 3)),
        3: {"nested": torch.arange(4)},
        "nan": float("nan"),
        "inf": -float("inf"),
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "arr": np.arange(3, dtype=np.int64),
        "np_scalar": np.float32(1.5),
    }
    tree, leaves = flatten(state)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # strict JSON, no pickle
    out = unflatten(tree, lambda i, nd: leaves[i].tensor.numpy() if nd else leaves[i].tensor)
    assert out["a"] == [1, 2.5, "x", None, True]
    assert out["t"] == (1, (2, 3))
    assert torch.equal(out[3]["nested"], torch.arange(4))
    assert math.isnan(out["nan"]) and out["inf"] == -float("inf")
    assert out["bytes"] == b"\x00\xff"
    assert out["dtype"] is torch.bfloat16
    assert isinstance(out["arr"], np.ndarray) and out["arr"].tolist() == [0, 1, 2]
    assert out["np_scalar"] == 1.5
    assert [leaf.path for leaf in leaves] == [".3.nested", ".arr"]


def test_unsupported_leaf_names_its_path() -> None:
    with pytest.raises(UnsupportedStateError, match=r"\.opt\.fn .*function"):
        flatten({"opt": {"fn": lambda: 0}})
