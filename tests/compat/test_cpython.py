"""stalwart.compat.cpython against this interpreter: a fresh one (the handlers and
threads of the test process are left alone) runs its exit handlers and joins its threads
through the seam, then ``os._exit``s like a zygote's worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._seam import changed

V = f"python {sys.version.split()[0]}"

_SCRIPT = """
import atexit, os, threading
from stalwart.compat import cpython
release = threading.Event()
def worker():
    release.wait()
    print("thread done", flush=True)
threading.Thread(target=worker).start()
atexit.register(lambda: print("first registered", flush=True))
atexit.register(lambda: print("last registered", flush=True))
release.set()
cpython.join_threads_at_exit()
print("joined", flush=True)
cpython.run_exit_handlers()
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_threads_are_joined_and_handlers_run_last_first() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=110, check=True
    ).stdout.splitlines()
    assert out == ["thread done", "joined", "last registered", "first registered"], changed(
        "threading._shutdown / atexit._run_exitfuncs", V, "cpython", f"gave {out}"
    )
