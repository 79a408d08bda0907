"""Hang detection for plain scripts: step progress from the optimizer.

A script that never calls ``stalwart.init()`` still steps an optimizer. The zygote installs
global optimizer step hooks in every worker it forks; each step is published to the progress
board (mode ``OBSERVED``), and a heartbeat thread keeps the slot's ``t_alive`` fresh (a
process blocked in a collective releases the GIL; a SIGSTOPped or frozen one does not). A
step is an outermost ``optimizer.step()`` (agent/processes/_outer_step.py): a container's step and
its inner optimizers' are one. The agent then detects a hang exactly as for the stalwart
runtime, and recovers the only way a plain script can be recovered: torchrun's route, every
worker restarted (within ``--max-restarts``). torchrun itself notices such a hang only when
a collective times out (30 minutes by default).

Why the optimizer and not a timer or a profiler: an optimizer step is the one event every
training loop has, once per step, and the hook costs a few microseconds. Scripts that step
no optimizer (inference, evaluation) are simply not watched. When the script does call
``stalwart.init()``, the runtime takes the slot over (:func:`detach`).

At the first step, rank 0 checks that a process group spans the job: a Trainer or
Accelerate script on CPU without ``--use_cpu`` forms none under torchrun and silently
trains independent replicas; a warning line says so (:func:`independent_replicas`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Any

from stalwart.agent.processes._outer_step import OuterSteps
from stalwart.agent.processes._plain_chaos import install_plain_chaos
from stalwart.contract.board import OBSERVED, ProgressBoard, on_runtime_attach

__all__ = ["detach", "independent_replicas", "install", "warn_independent_replicas", "watching"]

_WINDOW = 64  # recent step intervals kept for the p99


class _Observer:
    def __init__(self, board: ProgressBoard, slot: int) -> None:
        self.board = board
        self.slot = slot
        self.step = 0  # outermost optimizer steps of this process
        # the step this process resumed after, from its optimizers' state at its first
        # step (a script that loaded its own checkpoint); None: no step count in it
        self.resumed: int | None = None
        self.t_last = 0.0
        self.intervals: deque[float] = deque(maxlen=_WINDOW)
        self.stop = threading.Event()
        self.remove: Any = None  # removes the optimizer hooks
        self.chaos: Any = None  # step-keyed chaos faults (agent/processes/_plain_chaos.py), or None
        self.thread = threading.Thread(target=self._beat, name="stalwart-observe", daemon=True)

    def each_step(self, opt: Any) -> None:
        """Before every optimizer step (nested ones too): until the first step is done,
        the highest step count held in an optimizer's state (Adam's ``step``)."""
        if self.step == 0:
            found = _saved_step(opt)
            if found is not None and (self.resumed is None or found > self.resumed):
                self.resumed = found

    def before_step(self) -> None:
        if self.chaos is not None:
            last = self.intervals[-1] if self.intervals else 0.0
            self.chaos.before(self.step + 1, last)  # a plan's steps count from 1 per process

    def on_step(self) -> None:
        now = time.time()
        if self.t_last:
            self.intervals.append(now - self.t_last)
        self.t_last = now
        self.step += 1
        if self.step == 1:
            warn_independent_replicas()
        ordered = sorted(self.intervals)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
        self.board.write(
            self.slot,
            pid=os.getpid(),
            step=self.step + (self.resumed or 0),  # the script's own step number if known
            phase="step",
            generation=0,
            t_progress=now,
            t_alive=now,
            p99_s=p99,
            mode=OBSERVED,
            resumed=0 if self.resumed is None else self.resumed + 1,
        )

    def _beat(self) -> None:
        while not self.stop.wait(0.1):
            if self.step:  # the slot is ours once the first step wrote it
                self.board.touch(self.slot, time.time())


def _saved_step(opt: Any) -> int | None:
    """The highest ``step`` in ``opt``'s per-parameter state (None: none holds one)."""
    found: int | None = None
    for st in list(opt.state.values()):
        value = st.get("step") if isinstance(st, dict) else None
        if value is None:
            continue
        try:
            n = int(float(value))
        except (TypeError, ValueError, RuntimeError):
            continue
        found = n if found is None else max(found, n)
    return found


def independent_replicas(world_size: int, initialized: bool, group_size: int) -> str | None:
    """The warning for a job of ``world_size`` workers whose worker stepped its optimizer
    with no process group across the job (``initialized``: torch.distributed is, with a
    default group of ``group_size``); None when the group spans the job."""
    if world_size <= 1 or (initialized and group_size == world_size):
        return None
    what = f"a process group of {group_size}" if initialized else "no process group"
    return (
        f"stalwart: warning: the first optimizer step ran with {what} across the job's "
        f"{world_size} workers: they train {world_size} independent replicas (no gradient "
        "is averaged). transformers' Trainer and Accelerate on CPU form no group under "
        "torchrun unless told to use the CPU: pass --use_cpu (TrainingArguments(use_cpu="
        "True)) or set ACCELERATE_USE_CPU=1; a plain script: init_process_group and DDP"
    )


def warn_independent_replicas() -> None:
    """Rank 0 says so once, on stderr, when the job's workers train independently."""
    if os.environ.get("RANK", "0") != "0":
        return
    import torch.distributed as dist

    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    initialized = dist.is_available() and dist.is_initialized()
    line = independent_replicas(world, initialized, dist.get_world_size() if initialized else 1)
    if line is not None:
        print(line, file=sys.stderr, flush=True)


_OBSERVER: _Observer | None = None


def install(board_path: str, slot: int) -> None:
    """Watch this process's optimizer steps (called in a freshly forked worker)."""
    global _OBSERVER
    if _OBSERVER is not None:
        return
    observer = _Observer(ProgressBoard(board_path, slot + 1), slot)
    observer.chaos = install_plain_chaos()
    # one step per outermost optimizer.step(): a container's and its optimizers' are one
    steps = OuterSteps(observer.before_step, observer.on_step, observer.each_step)
    observer.remove = steps.install()
    observer.thread.start()
    _OBSERVER = observer
    on_runtime_attach(detach)


def watching() -> bool:
    """Whether this process's optimizer steps are being watched (:func:`install`)."""
    return _OBSERVER is not None


def detach() -> None:
    """Stop watching (the stalwart runtime publishes this worker's progress itself)."""
    global _OBSERVER
    observer, _OBSERVER = _OBSERVER, None
    if observer is None:
        return
    observer.remove()
    observer.stop.set()
    observer.thread.join(timeout=1.0)
