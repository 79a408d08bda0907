"""Deferred deletion of a lost node's shared-memory state.

When a node is lost, its ranks' snapshot slots on this host (on one machine, the same
/dev/shm) must go: their names are the adopted ranks' now. Freeing them is not cheap:
about 1 GB of tmpfs pages per node here takes 0.1-0.3 s of CPU in the kernel, and done
at once it competed with the recovery that follows on the same cores (the survivors'
restore of 256 MB each took 0.11-0.12 s instead of 0.055 s, bench/node_loss.py). So a
directory is renamed at once (the name is free for its next owner) and deleted in the
background only once this node's workers have recovered, or after ``max_wait_s`` in
any case (a recovery that never ends must not keep the memory forever).

Trade-off: the lost node's pages stay allocated for the length of one recovery.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import time

__all__ = ["Trash"]


class Trash:
    def __init__(self, max_wait_s: float = 30.0) -> None:
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[str, float]] = []  # renamed path, when
        self._threads: list[threading.Thread] = []

    def add(self, path: str) -> None:
        """Rename ``path`` out of the way now; it is deleted at a later :meth:`collect`."""
        trash = f"{path}.gone-{secrets.token_hex(4)}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        self._pending.append((trash, time.monotonic()))

    @property
    def pending(self) -> list[str]:
        return [p for p, _ in self._pending]

    def collect(self, recovered: bool) -> None:
        """Start deleting what is pending if the recovery is over (``recovered``) or the
        oldest entry waited ``max_wait_s``."""
        if not self._pending:
            return
        if not recovered and time.monotonic() - self._pending[0][1] < self.max_wait_s:
            return
        paths, self._pending = [p for p, _ in self._pending], []
        t = threading.Thread(target=_remove, args=(paths,), daemon=True, name="stalwart-trash")
        t.start()
        self._threads.append(t)

    def close(self, timeout: float = 30.0) -> None:
        """Delete everything still pending and wait for the deletions (agent shutdown)."""
        self.collect(recovered=True)
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()


def _remove(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
