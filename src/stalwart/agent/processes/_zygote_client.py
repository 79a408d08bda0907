"""The agent's side of the zygote protocol (see ``_zygote``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from stalwart.agent.processes._proc import read_cpu
from stalwart.errors import StalwartError

__all__ = ["ZygoteClient", "ZygoteNotReady"]


class ZygoteNotReady(StalwartError):
    """The zygote used its CPU budget, or stalled, before it answered ``ready``."""


def _cpu_s(pid: int) -> float | None:
    """CPU seconds ``pid`` and its live children used so far (/proc); None where /proc
    cannot tell (not Linux, the process gone)."""
    got = read_cpu(pid)
    return None if got is None else got[1]


class _StartClock:
    """Judges a starting zygote by its CPU time: it fails past ``cpu_s`` of CPU, or
    after ``stall_s`` wall seconds without any. Where /proc cannot tell, the wall time
    since the start stands in for the CPU time (``cpu_s`` is then a wall deadline)."""

    def __init__(self, pid: int, cpu_s: float, stall_s: float) -> None:
        self._pid, self._budget_s, self._stall_s = pid, cpu_s, stall_s
        self._t0 = self._t_busy = time.monotonic()
        self._cpu = _cpu_s(pid) or 0.0

    def failed(self) -> str | None:
        now, cpu = time.monotonic(), _cpu_s(self._pid)
        if cpu is None:
            cpu = now - self._t0
        elif cpu > self._cpu:
            self._cpu, self._t_busy = cpu, now
        waited = now - self._t0
        if cpu > self._budget_s:
            return (
                f"the zygote used {cpu:.0f} s of CPU in {waited:.0f} s without answering "
                f"'ready' (--zygote-ready-cpu {self._budget_s:g}): an import of the script "
                "or its preload runs that long or loops; raise --zygote-ready-cpu if it "
                "is meant to, else see the agent's stderr"
            )
        if now - self._t_busy > self._stall_s:
            return (
                f"the zygote used no CPU for {now - self._t_busy:.0f} s before answering "
                f"'ready' (--zygote-stall {self._stall_s:g}; {cpu:.1f} s of CPU in "
                f"{waited:.0f} s): an import is stuck (a hung file system, a lock); see "
                "the agent's stderr, or raise --zygote-stall"
            )
        return None


class ZygoteClient:
    def __init__(self, preload: list[str], env: dict[str, str], *, script: str = "") -> None:
        """``preload``: modules to import before the first fork; ``script``: the training
        script, whose top-level imports are preloaded too (agent/processes/_preload.py)."""
        ctl_r, self._ctl_w = os.pipe()
        self._evt_r, evt_w = os.pipe()
        flags = ["--script", script] if script else []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stalwart.agent.processes._zygote",
                str(ctl_r),
                str(evt_w),
                *flags,
                *preload,
            ],
            pass_fds=(ctl_r, evt_w),
            env=env,
        )
        os.close(ctl_r)
        os.close(evt_w)
        self._buf = b""
        self._backlog: list[dict[str, Any]] = []
        self.import_s = 0.0

    def pid(self) -> int:
        return int(self.proc.pid)

    def send(self, msg: dict[str, Any]) -> None:
        os.write(self._ctl_w, (json.dumps(msg) + "\n").encode())

    def events(self, timeout: float, wake: int | None = None) -> list[dict[str, Any]]:
        """Messages from the zygote, waiting up to ``timeout`` for the first (or until
        ``wake`` is readable: then maybe none)."""
        if self._backlog:
            out, self._backlog = self._backlog, []
            return out
        poller = select.poll()  # (select() refuses descriptors from 1,024 up)
        for fd in [self._evt_r] if wake is None else [self._evt_r, wake]:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(max(0, math.ceil(timeout * 1000)))}
        if self._evt_r not in ready:
            return []
        chunk = os.read(self._evt_r, 1 << 20)
        if not chunk:
            raise StalwartError("the zygote process died; see the agent's stderr")
        self._buf += chunk
        out = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            out.append(json.loads(line))
        return out

    def wait_for(self, op: str, timeout: float) -> dict[str, Any]:
        """The next message ``op``; others seen meanwhile are kept for ``events``."""
        deadline = time.monotonic() + timeout

        def late() -> str | None:
            if time.monotonic() > deadline:
                return f"the zygote did not answer {op!r} within {timeout:.0f}s"
            return None

        return self._wait(op, late)

    def wait_ready(self, cpu_s: float, stall_s: float) -> dict[str, Any]:
        """The zygote's ``ready`` (its start report), however loaded the machine:
        :class:`ZygoteNotReady` once it used ``cpu_s`` of CPU, or none for ``stall_s``
        seconds, without answering (agent/config.py ``ZygoteStart``)."""
        clock = _StartClock(self.pid(), cpu_s, stall_s)
        return self._wait("ready", clock.failed, error=ZygoteNotReady)

    def _wait(
        self,
        op: str,
        failed: Callable[[], str | None],
        error: type[StalwartError] = StalwartError,
    ) -> dict[str, Any]:
        """The next message ``op``, looking at ``failed()`` at least once a second;
        others seen meanwhile are kept for ``events``."""
        kept: list[dict[str, Any]] = []
        try:
            while True:
                for msg in self.events(1.0):
                    if msg.get("op") == op:
                        return msg
                    kept.append(msg)
                if (why := failed()) is not None:
                    raise error(why)
        finally:
            self._backlog.extend(kept)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._ctl_w)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.close(self._evt_r)
