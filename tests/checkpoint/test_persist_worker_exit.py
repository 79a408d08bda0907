"""The persister process outlives a dead parent quietly."""

from __future__ import annotations

import subprocess
import sys

import pytest


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
        assert proc.wait(timeout=30) == 0
        assert err == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
