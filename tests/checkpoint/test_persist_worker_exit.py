"""The persister process ends quietly with its parent, never after it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from _load import scaled


@pytest.mark.timeout(60)
def test_a_reply_to_a_parent_that_is_gone_ends_the_worker_without_a_traceback() -> None:
    """The parent's end of the pipe closed (the worker was killed) while a persist was
    in flight: the reply cannot be written. The worker exits 0 and writes nothing to
    stderr (it was a BrokenPipeError traceback in the job's log)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart.checkpoint._persist_worker", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
        assert '"ready": true' in proc.stdout.readline()
        proc.stdout.close()  # the parent is gone: nobody reads the replies
        proc.stdin.write('{"op": "persist", "id": 1}\n')  # answered (an error reply)
        proc.stdin.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=scaled(30)) == 0
        assert err == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


PARENT = """
import os, signal, subprocess, sys, time
p = subprocess.Popen([sys.executable, "-m", "stalwart.checkpoint._persist_worker", "10"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert '"ready": true' in p.stdout.readline()
holder = os.fork()  # a forked helper (a DataLoader worker) holds the pipes too
if holder == 0:
    time.sleep(600)
    os._exit(0)
print(p.pid, holder, flush=True)
time.sleep(600)  # until killed: no exit request is sent
"""


@pytest.mark.timeout(300)
def test_it_ignores_ctrl_c_and_leaves_with_a_parent_that_was_killed() -> None:
    # a worker the agent SIGKILLs closes its persister's stdin only if no forked helper
    # of its holds the pipe too; the persister must not wait for that, nor tear its
    # interpreter down at a niced pace after a Ctrl-C (either held the launcher's stderr
    # open after the job ended, tests/agent/test_worker_exit.py)
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child, holder = (int(x) for x in parent.stdout.readline().split())
        assert _ignores_sigint(child)  # a Ctrl-C reaches the whole group: its parent decides
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 120
        while _alive(child):  # its stdin is still open (the holder), its parent gone
            assert time.monotonic() < deadline, "the persister outlived its killed parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        with contextlib.suppress(UnboundLocalError, ProcessLookupError):
            os.kill(holder, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))
