"""stalwart.compat.numpy_pickle against the installed numpy: an unpickler that resolves
only :func:`array_globals` (by identity) reads pickled arrays and scalars."""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import numpy as np

from stalwart.compat import numpy_pickle

from ._seam import changed

V = f"numpy {np.__version__}"


class _Only(pickle.Unpickler):
    allowed: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        found = getattr(importlib.import_module(module), name)
        if any(found is a for a in self.allowed):
            return found
        raise pickle.UnpicklingError(
            changed(f"{module}.{name}", V, "numpy_pickle.array_globals", "is named by a pickle")
        )


def test_pickled_arrays_and_scalars_name_only_the_listed_globals() -> None:
    _Only.allowed = numpy_pickle.array_globals()
    values = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([True, False]),
        np.int64(7),
        np.random.default_rng(0).bit_generator.state["state"]["state"],
        np.random.get_state()[1][:4],
    ]
    for value in values:
        back = _Only(io.BytesIO(pickle.dumps(value))).load()
        assert np.array_equal(back, value)
        assert type(back) is type(value)
