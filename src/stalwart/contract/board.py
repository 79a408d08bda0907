"""The progress board: per-worker step progress in a small shared-memory file.

Why shared memory and not the store: a worker writes its slot at every step, and the
agent reads all slots every few milliseconds, at the cost of a memory access each; no
socket or lock is involved, so the board works while the store or the network is the
thing that is broken. A heartbeat thread in the worker refreshes ``t_alive``: a process
blocked in a collective keeps it fresh (the collective releases the GIL); the agent
tells a hung rank from a busy one by the process's state and CPU time, not by the
heartbeat (agent/detection/hang.py). Phase ``paused`` is ``with sess.pause(...)``: declared
non-step work (an eval, a save) that is never judged by step time.

Format version 2 (docs/recovery.md, "The progress board"): a 64-byte header (magic,
version, slot size, slot count) and 96-byte slots. Version 2 added each worker's
*compute time*: the seconds its steps spent outside collectives and pauses, summed
since its process started, and how many steps that sum covers. Its peers' waits in a
collective for a slow rank are not compute, so the straggler detector
(agent/detection/stragglers.py) compares ranks by it; step time cannot tell them apart in a
synchronous job (every rank's step takes as long as the slowest). Version 1 (no header,
64-byte slots) is refused with a message naming the fix: the board lives only as long as
its agent, whose workers run the same install, so a mismatch is a mixed install.

The file is read without torch (the agent never imports it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from stalwart.errors import StalwartError
from stalwart.privfile import open_own

__all__ = [
    "ATTACHED",
    "BOARD_VERSION",
    "OBSERVED",
    "PHASES",
    "BoardFormatError",
    "ProgressBoard",
    "Slot",
    "on_runtime_attach",
    "runtime_attaches",
]

BOARD_VERSION = 2
_MAGIC = b"STWBOARD"
_HEADER = "<8sIII"  # magic version slot_size slots
_HEADER_SIZE = 64
# pid step phase generation t_progress t_alive p99_s mode compute_s compute_steps resumed
_FMT = "<qqqqdddqdqq"
_SIZE = 96
assert struct.calcsize(_FMT) <= _SIZE and struct.calcsize(_HEADER) <= _HEADER_SIZE
_ALIVE_AT = 40  # offset of t_alive in a slot
PHASES = ("starting", "step", "collective", "recovering", "done", "standby", "paused")
ATTACHED = 1
"""Mode of a slot written by the stalwart runtime (the worker can recover in place)."""
OBSERVED = 2
"""Mode of a slot written by :mod:`stalwart.agent.processes.observe` for a plain script: its steps
are watched for hangs, and it recovers by torchrun's route (restart everything)."""


_ATTACH_HOOKS: list[Callable[[], None]] = []


def on_runtime_attach(hook: Callable[[], None]) -> None:
    """Call ``hook`` once when the stalwart runtime takes this worker's slot over: the
    agent's watcher of a plain script (agent/processes/observe.py) registers its own stop, so the
    runtime stops it without importing the agent."""
    _ATTACH_HOOKS.append(hook)


def runtime_attaches() -> None:
    """The stalwart runtime is about to publish this worker's progress itself: run (and
    forget) the hooks :func:`on_runtime_attach` registered in this process."""
    hooks = list(_ATTACH_HOOKS)
    _ATTACH_HOOKS.clear()
    for hook in hooks:
        hook()


class BoardFormatError(StalwartError):
    """The progress board file is not of this install's format (version 2)."""


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
    compute_s: float = 0.0  # step time outside collectives and pauses, summed (this pid)
    compute_steps: int = 0  # steps summed into compute_s (0: none measured, e.g. a plain script)
    # a plain script's process: 1 + the step it resumed after, read from its optimizer's
    # state at its first step (0: not known; the field was reserved, 0, before)
    resumed: int = 0


class ProgressBoard:
    """``slots`` fixed 96-byte records after a 64-byte header in ``path``; the agent
    creates it, workers map it."""

    def __init__(self, path: str, slots: int, *, create: bool = False) -> None:
        self.path = path
        self.slots = slots
        size = _HEADER_SIZE + slots * _SIZE
        fd = open_own(path, create=create)  # O_EXCL; a foreign file is refused
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise BoardFormatError(_mismatch(path, "shorter than its slots"))
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if create:
            struct.pack_into(_HEADER, self._map, 0, _MAGIC, BOARD_VERSION, _SIZE, slots)
            return
        magic, version, slot_size, _ = struct.unpack_from(_HEADER, self._map, 0)
        if magic != _MAGIC or version != BOARD_VERSION or slot_size != _SIZE:
            self._map.close()
            raise BoardFormatError(_mismatch(path, f"version {version}, slots of {slot_size} B"))

    def _at(self, index: int) -> int:
        if not 0 <= index < self.slots:
            raise IndexError(f"progress board slot {index} outside 0..{self.slots - 1}")
        return _HEADER_SIZE + index * _SIZE

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
        compute_s: float = 0.0,
        compute_steps: int = 0,
        resumed: int = 0,
    ) -> None:
        struct.pack_into(
            _FMT,
            self._map,
            self._at(index),
            pid,
            step,
            PHASES.index(phase),
            generation,
            t_progress,
            t_alive,
            p99_s,
            mode,
            compute_s,
            compute_steps,
            resumed,
        )

    def touch(self, index: int, t_alive: float) -> None:
        struct.pack_into("<d", self._map, self._at(index) + _ALIVE_AT, t_alive)

    def clear(self, index: int) -> None:
        at = self._at(index)
        self._map[at : at + _SIZE] = bytes(_SIZE)

    def read(self, index: int) -> Slot:
        (pid, step, phase, gen, tp, ta, p99, mode, compute_s, compute_steps, resumed) = (
            struct.unpack_from(_FMT, self._map, self._at(index))
        )
        name = PHASES[phase] if 0 <= phase < len(PHASES) else "starting"
        if not (compute_s >= 0.0 and compute_steps >= 0):  # torn or garbage: not measured
            compute_s, compute_steps = 0.0, 0
        return Slot(
            pid,
            step,
            name,
            gen,
            tp,
            ta,
            p99,
            mode == ATTACHED,
            mode == OBSERVED,
            compute_s,
            compute_steps,
            max(resumed, 0),
        )

    def close(self, *, unlink: bool = False) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _mismatch(path: str, seen: str) -> str:
    return (
        f"progress board {path} is not format version {BOARD_VERSION} ({seen}): the worker "
        "and its agent run different stalwart installs; run both from one install"
    )
