"""The agent's side of the zygote protocol (see ``_zygote``)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

from stalwart.errors import StalwartError

__all__ = ["ZygoteClient"]


class ZygoteClient:
    def __init__(self, preload: list[str], env: dict[str, str], *, script: str = "") -> None:
        """``preload``: modules to import before the first fork; ``script``: the training
        script, whose top-level imports are preloaded too (agent/_preload.py)."""
        ctl_r, self._ctl_w = os.pipe()
        self._evt_r, evt_w = os.pipe()
        flags = ["--script", script] if script else []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stalwart.agent._zygote",
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
        fds = [self._evt_r] if wake is None else [self._evt_r, wake]
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
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
        kept: list[dict[str, Any]] = []
        try:
            while True:
                for msg in self.events(deadline - time.monotonic()):
                    if msg.get("op") == op:
                        return msg
                    kept.append(msg)
                if time.monotonic() > deadline:
                    raise StalwartError(f"the zygote did not answer {op!r} within {timeout:.0f}s")
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
