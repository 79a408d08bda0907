"""A world of spawned gloo ranks for a test, each ending the way stalwart's workers end.

``torch.multiprocessing.spawn`` returns from the rank's function and lets the interpreter
finalize. With torch 2.13's gloo that aborts a rank now and then ("terminate called
without an active exception", SIGABRT; 1 run in 14 of the checkpoint world tests): a
group's worker thread still holds the last finished work of an async collective (an
allgather under ``full_tensor()`` or a checkpoint's barrier), and releasing its tensors
takes the GIL; during ``Py_FinalizeEx`` a thread that asks for the GIL is ended with
``pthread_exit``, whose forced unwind through gloo's ``noexcept`` loop is
``std::terminate``. The work the test judges is done and checked by then. A rank here
flushes its output and leaves with ``os._exit(0)`` once its function has returned, as a
worker under ``stalwart run`` does (src/stalwart/agent/processes/_teardown.py); a rank whose
function raises still reports the exception through ``spawn`` and fails the test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["spawn_world"]


def _rank(rank: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    fn(rank, *args)  # an exception goes back to spawn (the test fails with its traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_world(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes and wait for all of them;
    raises what a rank raised, or that a rank died."""
    mp.spawn(_rank, args=(fn, args), nprocs=nprocs, join=True)
