"""The one seam between stalwart and other projects' internals.

Every private API of torch, Transformers, Lightning, numpy and CPython that stalwart
uses is called from a module of this package, one per dependency and concern
(:mod:`~stalwart.compat.torch_c10d`, :mod:`~stalwart.compat.torch_ddp`,
:mod:`~stalwart.compat.torch_optim`, :mod:`~stalwart.compat.torch_data`,
:mod:`~stalwart.compat.torch_dcp`, :mod:`~stalwart.compat.transformers_trainer`,
:mod:`~stalwart.compat.lightning_trainer`, :mod:`~stalwart.compat.numpy_pickle`,
:mod:`~stalwart.compat.cpython`), each use documented with what it relies on and why no
public way exists, and each tested by tests/compat/ on the installed versions: an
upgrade that changes one fails there, naming it. Nothing outside this package names
another project's private attribute or module (tests/test_structure.py).

This module itself imports nothing heavy: :func:`torch_version_problem` reads the
installed torch's version from its package metadata, so the CLI can check it before
anything imports torch.
"""

from __future__ import annotations

import re

__all__ = ["TESTED_TORCH", "torch_version_problem"]

# the torch releases (major, minor) this version of stalwart is tested with, oldest and
# newest; pyproject's bound says the same
TESTED_TORCH = ((2, 13), (2, 13))


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def torch_version_problem(version: str | None = None) -> str | None:
    """One line saying that the installed torch (or ``version``) is outside
    :data:`TESTED_TORCH`, and the fix; None when it is inside (or torch is absent: the
    import that needs it says so)."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return None
    release = _release(version)
    low, high = TESTED_TORCH
    if release is not None and low <= release <= high:
        return None
    tested = ".".join(map(str, low))
    if high != low:
        tested += "-" + ".".join(map(str, high))
    return (
        f"torch {version} is outside the versions stalwart is tested with ({tested}): "
        f"stalwart leans on torch internals (stalwart.compat) that may differ; install "
        f"torch {tested} (pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}')"
    )
