"""Every scored straggler window of a running job, for bench/_detect_straggler.py.

The agent keeps only its declarations; to see how close a fault-free rank comes to one
(and to compare persistence rules on the same seconds of the same machine) this thread
reads the job's progress board as the agent does, scores the same windows with the
same :class:`~stalwart.agent.detection.stragglers.StragglerWindows`, and writes one JSON line per
window: ``{"t", "ranks": {rank: [ratio, z, flagged]}, "declared": [rank...]}``.
"""

from __future__ import annotations

import glob
import json
import threading
import time
from pathlib import Path

from stalwart.agent.detection.stragglers import StragglerConfig, StragglerWindows
from stalwart.contract.board import ProgressBoard

__all__ = ["WindowTrace"]


class WindowTrace:
    """Follows the board of job ``job`` (node 0, ``ranks`` slots) into ``out``."""

    def __init__(self, job: str, ranks: int, out: Path) -> None:
        self._job, self._ranks, self._out = job, ranks, out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="window-trace", daemon=True)
        self._thread.start()

    def _board(self) -> ProgressBoard | None:
        while not self._stop.is_set():
            found = glob.glob(f"/dev/shm/stalwart-{self._job}-*-progress-n0")
            if found:
                time.sleep(0.5)  # let the agent size it
                return ProgressBoard(found[0], self._ranks)
            time.sleep(0.2)
        return None

    def _run(self) -> None:
        board = self._board()
        if board is None:
            return
        windows, last = StragglerWindows(StragglerConfig()), None
        with open(self._out, "w") as f:
            while not self._stop.wait(0.02):
                try:
                    slots = {r: board.read(r) for r in range(self._ranks)}
                except (OSError, ValueError):
                    return  # the board went with its job
                declared = windows.observe(slots, time.time())
                if windows.last is not last:
                    last = windows.last
                    ranks = {sc.rank: [round(sc.ratio, 3), round(sc.z, 2), sc.flagged]
                             for sc in last}  # fmt: skip
                    rec = {"t": time.time(), "ranks": ranks,
                           "declared": [d.score.rank for d in declared]}  # fmt: skip
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
        board.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
