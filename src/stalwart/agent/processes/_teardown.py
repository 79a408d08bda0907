"""How a forked worker ends: like ``python script.py``, minus the destructors that hang.

``python script.py`` joins the non-daemon threads, runs the ``atexit`` handlers, flushes
stdio, then tears the interpreter down. A zygote's worker does the first three
(:func:`finish`) and then ``os._exit``: it never tears down the script's globals, whose
destructors (a DDP model's, its gloo group's) blocked for minutes after the peer had
exited (agent/processes/_zygote.py holds them).

A group the script destroys itself is the other way in. ``destroy_process_group()``
unregisters it, so its last reference is the DDP model's reducer; when ``main()`` returns,
the reducer's release runs ``~ProcessGroupGloo`` on the main thread with the GIL held, and
that destructor joins the group's worker threads. A worker thread releasing the last
allreduce of the backward pass needs the GIL (the work holds the backward's context, a
Python object, in its thread-local state): both wait for ever. The race exists under
``python script.py`` too, but there the thread releases its work before the main thread
gets that far; in a zygote's worker (torch._dynamo preloaded, the inherited heap frozen
out of the collector) the main thread got there first in about a third of the runs of a
DDP tutorial-style script (examples/corpus/ddp_tutorial.py) at load ~20, and the same
script under ``python`` with those two preparations hung as often. :func:`hold_destroyed_groups`
keeps every group the script destroys referenced until ``os._exit``: its destructor never
runs, as for the groups a script leaves to the interpreter's end (which joins no thread
that waits for the GIL: threads asking for it at finalization exit).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from stalwart.compat import cpython

__all__ = ["finish", "hold_destroyed_groups"]

_HELD: list[Any] = []  # process groups the script destroyed: kept until os._exit
_HOLDING: list[bool] = []  # [True] once destroy_process_group holds them (one install)


def hold_destroyed_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep the groups it destroys
    referenced (called in a forked worker before its script runs; what the group does
    and what the script sees are unchanged)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from stalwart.compat import torch_c10d

    if _HOLDING:
        return
    _HOLDING.append(True)
    original = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        with contextlib.suppress(Exception):  # what it destroys: all of them, or one
            _HELD.extend(torch_c10d.registered_groups() if group is None else [group])
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def exit_code(exc: SystemExit) -> int:
    """What ``python script.py`` exits with after ``sys.exit(c)``."""
    c = exc.code
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    with contextlib.suppress(Exception):
        print(c, file=sys.stderr)
    return 1


def finish(code: int) -> int:
    """The end of ``python script.py``: wait for non-daemon threads, run the ``atexit``
    handlers (wandb-style finalizers, log flushes), flush stdio; ``code`` is kept (a
    handler's ``sys.exit`` sets it, as in Python)."""
    with contextlib.suppress(BaseException):
        cpython.join_threads_at_exit()
    try:
        cpython.run_exit_handlers()  # prints and swallows a handler's exception itself
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        pass
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def _flush_open_files() -> None:
    """What the interpreter's teardown would have done for files the script left open
    (``f = open(...); f.write(...)`` with no close): flush them. The worker ends with
    ``os._exit``, which writes no buffer, and it never tears its globals down."""
    import gc
    import io

    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(BaseException):
                if not obj.closed and obj.writable():
                    obj.flush()
