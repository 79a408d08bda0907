"""stalwart: a fault-tolerance runtime for PyTorch training.

Importing ``stalwart`` has no side effects and does not import torch; the parts are
imported where they are used (``stalwart.checkpoint``, ``stalwart.sim``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stalwart.errors import StalwartError, StepFailedError

if TYPE_CHECKING:
    from stalwart.runtime import Session, init

__all__ = ["Session", "StalwartError", "StepFailedError", "__version__", "init"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # PEP 562: `stalwart.init` imports the runtime (and torch) only when used
    if name in ("init", "Session"):
        import stalwart.runtime

        return getattr(stalwart.runtime, name)
    if name == "data":  # `stalwart.data.loader(...)` after a bare `import stalwart`
        import stalwart.data

        return stalwart.data
    raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
