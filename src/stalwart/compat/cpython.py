"""CPython's interpreter-exit internals stalwart relies on.

A zygote's worker ends like ``python script.py`` without the interpreter's teardown
(agent/processes/_teardown.py): it joins the non-daemon threads and runs the ``atexit`` handlers
itself, then ``os._exit``. Python has no public call for either step of its own exit.
tests/compat/test_cpython.py fails when CPython changes them. Tested with 3.11-3.13.
"""

from __future__ import annotations

import atexit
import threading

__all__ = ["join_threads_at_exit", "run_exit_handlers"]


def join_threads_at_exit() -> None:
    """Join the non-daemon threads as the interpreter does at exit
    (``threading._shutdown``)."""
    threading._shutdown()  # type: ignore[attr-defined]


def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now, last registered first (``atexit._run_exitfuncs``;
    it prints and swallows a handler's exception itself, a ``SystemExit`` escapes)."""
    atexit._run_exitfuncs()
