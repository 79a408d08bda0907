"""The bytecode of the project's own modules, cached for a test run (issue 26).

CI's machines (and these sessions) set ``PYTHONDONTWRITEBYTECODE=1``: no ``__pycache__``
is ever written, so every process compiled every module of the project it imported from
source, every time. The test run is hundreds of processes that import stalwart (each
job's agent and zygote, each torchrun worker of a corpus script), and pytest rewrote the
asserts of every test file again at every collection. Measured (2 cores, load 4-20): a
collection used 22-23.5 s of CPU without the cache and 11-12 s with it; a small job
(nanoGPT, 2 ranks, 20 steps) 8.2-8.5 s of CPU without, 7.1-7.5 s with.

What is written, and what is not:

- :func:`precompile`, at the start of the run: ``src/`` and ``examples/`` (what the jobs
  import), by :mod:`compileall` (only what is missing or older than its source).
- :func:`bytecode_written`, around the collection: the modules collection imports (the
  test files, their helpers, stalwart) and pytest's rewritten test files.

Nothing else: while the tests run, the environment's setting holds, in this process and
in every process it starts. A test that writes a module, imports it, and rewrites it
within the same second at the same size would otherwise read the old bytecode (Python
checks the source's mtime in whole seconds and its size), the preloaded-module tests
among them (agent/processes/_local_preload.py). Python reads bytecode even where it writes none,
and checks it against the source, so an edited file of the project is compiled afresh.
"""

from __future__ import annotations

import compileall
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["TREES", "bytecode_written", "precompile"]

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "examples")  # what a job's processes import (tests/: the collection writes)


def precompile(root: Path = ROOT) -> bool:
    """Write the missing or stale bytecode of ``TREES`` under ``root``; False if a file
    did not compile (Python reports its syntax error where it is imported)."""
    ok = True
    for tree in TREES:
        if (root / tree).is_dir():
            ok = bool(compileall.compile_dir(root / tree, quiet=1)) and ok
    return ok


@contextlib.contextmanager
def bytecode_written() -> Iterator[None]:
    """Python writes the bytecode of what it imports inside (whatever the environment
    says), and goes back to the environment's setting after."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before
