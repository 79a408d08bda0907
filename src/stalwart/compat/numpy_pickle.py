"""numpy's pickling internals stalwart relies on.

A pickled numpy array names ``numpy._core.multiarray._reconstruct`` (numpy 1.x:
``numpy.core.multiarray``); the DCP import's restricted unpickler
(checkpoint/_dcp_import.py) must allow exactly what a plain array or scalar names, by
identity, and numpy offers no public list of them. tests/compat/test_numpy_pickle.py
fails when numpy changes them. Tested with numpy 2.4.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["array_globals"]


def array_globals() -> list[Any]:
    """What a pickled numpy array or scalar of a plain numeric dtype names: the
    array reconstructor, the scalar constructor, ``ndarray``, ``dtype`` and the dtype
    classes (not object arrays). Empty without numpy."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return []
    try:
        multiarray: Any = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # pragma: no cover - numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    kinds = [type(np.dtype(c)) for c in "?bhilqpBHILQPefdgFDG"]
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *kinds]
