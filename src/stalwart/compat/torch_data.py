"""torch.utils.data.DataLoader's internals stalwart relies on.

A DataLoader's worker processes stop only when its iterator is collected, and a
``persistent_workers`` loader keeps its iterator for the next epoch; stalwart's loaders
stop them at ``close()`` and at a reshard (data/loader.py, data/epochs.py). torch has no
public way to do either. tests/compat/test_torch_data.py fails when torch changes them.
Tested with torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["forget_iterator", "worker_shutdown"]


def worker_shutdown(it: Any) -> Callable[[], None] | None:
    """The call that stops ``it``'s worker processes now
    (``_MultiProcessingDataLoaderIter._shutdown_workers``); None for an iterator without
    workers (a single-process loader's, or ``None``)."""
    shutdown: Callable[[], None] | None = getattr(it, "_shutdown_workers", None)
    return shutdown


def forget_iterator(dl: Any) -> None:
    """Drop the iterator a ``persistent_workers`` DataLoader keeps for its next epoch
    (``DataLoader._iterator``), so that the next ``iter()`` makes new workers."""
    dl._iterator = None
