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

This module itself imports nothing heavy: :func:`torch_version_problem` finds the
installed torch's version without importing it, so the CLI can check it before anything
imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable

__all__ = ["TESTED_TORCH", "installed_torch", "torch_version_problem", "warn_untested_torch"]

# the torch releases (major, minor) this version of stalwart is tested with, oldest and
# newest; pyproject's bound says the same
TESTED_TORCH = ((2, 13), (2, 13))


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_torch() -> str | None:
    """The installed torch's version without importing torch (a CLI that starts workers
    need not pay for it): the loaded module's, else ``torch/version.py``'s
    ``__version__`` line (written by torch's build), else the package metadata (whose
    import costs about a second on a loaded machine); None without torch."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return str(loaded.__version__)
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(folder, "version.py")) as f:
                m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            continue
        if m:
            return m.group(1)
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def torch_version_problem(version: str | None = None) -> str | None:
    """One line saying that the installed torch (or ``version``) is outside
    :data:`TESTED_TORCH`, and the fix; None when it is inside (or torch is absent: the
    import that needs it says so)."""
    if version is None:
        version = installed_torch()
        if version is None:
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


_WARNED: list[str] = []


def warn_untested_torch(say: Callable[[str], None] | None = None) -> None:
    """Say :func:`torch_version_problem`'s line once per process (to stderr, prefixed
    ``stalwart: warning:``, or to ``say``); nothing when torch is in the tested range.
    Cheap: run where stalwart starts (``stalwart run``, a worker's session)."""
    if _WARNED:
        return
    problem = torch_version_problem()
    if problem is None:
        return
    _WARNED.append(problem)
    if say is None:
        print(f"stalwart: warning: {problem}", file=sys.stderr)
    else:
        say(problem)
