"""The progress board: per-worker step progress in a small shared-memory file.

Why shared memory and not the store: a worker writes its slot at every step, and the
agent reads all slots every few milliseconds, at the cost of a memory access each; no
socket or lock is involved, so the board works while the store or the network is the
thing that is broken. A heartbeat thread in the worker refreshes ``t_alive``: a process
blocked in a collective keeps it fresh (the collective releases the GIL); the agent
tells a hung rank from a busy one by the process's state and CPU time, not by the
heartbeat (agent/detect.py). Phase ``paused`` is ``with sess.pause(...)``: declared
non-step work (an eval, a save) that is never judged by step time.

The file is read without torch (the agent never imports it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass

__all__ = ["ATTACHED", "OBSERVED", "PHASES", "ProgressBoard", "Slot"]

_FMT = "<qqqqdddq"  # pid step phase generation t_progress t_alive p99_s mode
_SIZE = 64
assert struct.calcsize(_FMT) <= _SIZE
PHASES = ("starting", "step", "collective", "recovering", "done", "standby", "paused")
ATTACHED = 1
"""Mode of a slot written by the stalwart runtime (the worker can recover in place)."""
OBSERVED = 2
"""Mode of a slot written by :mod:`stalwart.agent.observe` for a plain script: its steps
are watched for hangs, and it recovers by torchrun's route (restart everything)."""


@dataclass(frozen=True)
class Slot:
    pid: int
    step: int
    phase: str
    generation: int
    t_progress: float  # wall clock of the last step boundary
    t_alive: float  # wall clock of the last heartbeat
    p99_s: float  # the worker's recent p99 step time
    attached: bool  # the worker runs the stalwart runtime
    observed: bool = False  # a plain script whose optimizer steps are watched


class ProgressBoard:
    """``slots`` fixed 64-byte records in ``path``; the agent creates it, workers map it."""

    def __init__(self, path: str, slots: int, *, create: bool = False) -> None:
        self.path = path
        self.slots = slots
        size = slots * _SIZE
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def write(
        self,
        index: int,
        *,
        pid: int,
        step: int,
        phase: str,
        generation: int,
        t_progress: float,
        t_alive: float,
        p99_s: float,
        mode: int = ATTACHED,
    ) -> None:
        struct.pack_into(
            _FMT,
            self._map,
            index * _SIZE,
            pid,
            step,
            PHASES.index(phase),
            generation,
            t_progress,
            t_alive,
            p99_s,
            mode,
        )

    def touch(self, index: int, t_alive: float) -> None:
        struct.pack_into("<d", self._map, index * _SIZE + 40, t_alive)

    def clear(self, index: int) -> None:
        self._map[index * _SIZE : (index + 1) * _SIZE] = bytes(_SIZE)

    def read(self, index: int) -> Slot:
        pid, step, phase, gen, tp, ta, p99, mode = struct.unpack_from(
            _FMT, self._map, index * _SIZE
        )
        name = PHASES[phase] if 0 <= phase < len(PHASES) else "starting"
        return Slot(pid, step, name, gen, tp, ta, p99, mode == ATTACHED, mode == OBSERVED)

    def close(self, *, unlink: bool = False) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
