"""`stalwart compare` leaves nothing running when it is stopped (issue 27).

A compare stand-in (the same launch and wait compare's route runner uses:
``_launch``, ``_finish`` under ``term_exits``) starts a launcher that starts a worker in
a session of its own, as torchrun does, and that worker ignores SIGTERM. SIGTERM to the
stand-in must leave neither; SIGKILL to it must still take the launcher down
(PR_SET_PDEATHSIG). Every process is named by PID and waited on with load-scaled
deadlines; whatever a failing test leaves is killed by PID at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _load import wait_until
from _terminal import ctrl_c_as_in_a_terminal

_LAUNCHER = """
import signal, subprocess, sys, time
worker = subprocess.Popen(
    [sys.executable, "-c",
     "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
    start_new_session=True,
)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{worker.pid}\\n")
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

_COMPARE = """
import os, sys
from pathlib import Path
from stalwart.cli._compare_run import _finish, _launch, term_exits
with term_exits():
    proc = _launch([sys.executable, "-c", sys.argv[1], sys.argv[2]], Path(sys.argv[3]),
                   dict(os.environ))
    with open(sys.argv[4] + ".tmp", "w") as f:
        f.write(f"{proc.pid}\\n")
    os.replace(sys.argv[4] + ".tmp", sys.argv[4])
    _finish(proc, 600.0, grace_s=2.0)
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pid(path: Path) -> int:
    assert wait_until(path.exists, 60), f"{path} never written"
    return int(path.read_text())


@contextlib.contextmanager
def _compare(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    worker_file, launcher_file = tmp_path / "worker.pid", tmp_path / "launcher.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", _COMPARE, _LAUNCHER, str(worker_file),
         str(tmp_path / "launcher.log"), str(launcher_file)],
        start_new_session=True,
        preexec_fn=ctrl_c_as_in_a_terminal,  # the INT case: a terminal's Ctrl-C
    )  # fmt: skip
    started: list[int] = []
    try:
        started.append(_pid(launcher_file))
        started.append(_pid(worker_file))
        yield proc, started[0], started[1]
    finally:
        for pid in [proc.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_terminated_compare_stops_its_launcher_and_the_workers_it_started(
    tmp_path: Path, sig: int
) -> None:
    with _compare(tmp_path) as (proc, launcher, worker):
        assert _alive(launcher) and _alive(worker)
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=120)
        assert rc in (143, -signal.SIGINT), rc  # SystemExit(143) / KeyboardInterrupt
        assert wait_until(lambda: not _alive(launcher), 30), "the launcher outlived compare"
        assert wait_until(lambda: not _alive(worker), 30), (
            "the worker (own session, ignores SIGTERM) outlived compare"
        )


def test_killed_compare_takes_its_launcher_down(tmp_path: Path) -> None:
    with _compare(tmp_path) as (proc, launcher, _worker):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert wait_until(lambda: not _alive(launcher), 30), (
            "the launcher outlived a SIGKILLed compare: no PR_SET_PDEATHSIG"
        )
