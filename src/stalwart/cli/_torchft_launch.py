"""The torchft route's launcher for ``stalwart compare``: a lighthouse and W replica groups.

torchft is run the way its README runs it, not through stalwart: one
``torchft_lighthouse`` (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``)
and one ``torchrun --max-restarts`` per replica group, each given ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE``. A killed worker is restarted by its own
group's torchrun and heals from a live group; the other groups drop it from their next
quorum and go on. compare signals the workers itself (torchft has no fault injector).

The job is done when group 0 exits (its records are what compare measures, and with
every group in one quorum they hold the same parameters): the others get a grace to
finish, then are stopped; the exit code is group 0's. Run as ``python -m
stalwart.cli._torchft_launch --workers W -- SCRIPT ARGS``; needs the ``torchft_lighthouse``
executable (``pip install '.[bench]'``), never imports torchft itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stalwart.chaos.proctree import die_with_parent

__all__ = ["lighthouse_binary", "main"]

_GRACE_S = 30.0  # the other groups' time to finish after group 0 did
_LIGHTHOUSE_FLAGS = ("--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000")


def lighthouse_binary() -> str | None:
    """The ``torchft_lighthouse`` executable beside this Python, or on PATH; None if absent."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"torchft_lighthouse exited {proc.returncode} at start")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise SystemExit(f"torchft_lighthouse did not listen on 127.0.0.1:{port} in {timeout_s:.0f}s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stalwart.cli._torchft_launch")
    p.add_argument("--workers", type=int, required=True, help="replica groups (one worker each)")
    p.add_argument("--grace", type=float, default=_GRACE_S, help="the others' time after group 0")
    p.add_argument("--lighthouse", default=None, help="the lighthouse executable (default: found)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS")
    args = p.parse_args(argv)
    cmd = [c for c in args.cmd if c != "--"] if args.cmd[:1] == ["--"] else args.cmd
    binary = args.lighthouse or lighthouse_binary()
    if binary is None or not cmd or args.workers < 1:
        print("torchft route: needs torchft_lighthouse (pip install '.[bench]'), --workers >= 1 "
              "and a script", file=sys.stderr)  # fmt: skip
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the groups on the way out
    port = _free_port()
    lighthouse = subprocess.Popen(
        [binary, "--bind", f"127.0.0.1:{port}", *_LIGHTHOUSE_FLAGS],
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    groups: list[subprocess.Popen[bytes]] = []
    try:
        _wait_listening(port, lighthouse, 60.0)
        torchrun = str(Path(sys.executable).parent / "torchrun")
        for g in range(args.workers):
            env = dict(os.environ, REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS=str(args.workers))
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the Manager joins torchrun's
            env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
            launcher = [torchrun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1000"]
            groups.append(
                subprocess.Popen(
                    [*launcher, *cmd], env=env, start_new_session=True, preexec_fn=die_with_parent
                )
            )
        rc = groups[0].wait()
        deadline = time.monotonic() + args.grace
        for proc in groups[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return rc
    finally:
        _stop([*groups, lighthouse])


if __name__ == "__main__":
    sys.exit(main())
