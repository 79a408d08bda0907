"""stalwart: a fault-tolerance runtime for PyTorch training.

Importing ``stalwart`` has no side effects and does not import torch; the parts are
imported where they are used (``stalwart.checkpoint``, ``stalwart.sim``, ...).
"""

from __future__ import annotations

from stalwart.errors import StalwartError

__all__ = ["StalwartError", "__version__"]

__version__ = "0.1.0"
