"""Client side of the background persister process (see ``_persist_worker``)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from stalwart.errors import CheckpointError, DiskFullError, FencedError

if TYPE_CHECKING:
    from stalwart.checkpoint.commit import CommitOutcome

__all__ = ["PersistConfig", "PersistResult", "Persister"]


@dataclass(frozen=True)
class PersistConfig:
    """``nice`` lowers the persister's CPU priority so training keeps its cores."""

    chunk_bytes: int = 4 << 20
    nice: int = 10
    start_timeout_s: float = 30.0


@dataclass
class PersistResult:
    step: int
    written_bytes: int
    total_bytes: int
    seconds: float
    committed: bool
    """Committed by the persister itself (alone: no coordinator to fence it)."""
    raw: dict[str, Any]
    commit: CommitOutcome | None = None
    """Persisted under a commit plan (a coordinator's fence): what became of the commit,
    carried out by the manager once the write was durable (checkpoint/commit.py)."""


_ERRORS: dict[str, type[CheckpointError]] = {"DiskFullError": DiskFullError}


class Persister:
    """Owns one persister process; requests run one at a time, in order."""

    def __init__(self, config: PersistConfig | None = None) -> None:
        self.config = config or PersistConfig()
        self._proc: subprocess.Popen[str] | None = None
        self._futures: dict[int, Future[PersistResult]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._broken: str | None = None  # why the reader stopped (no reply can come)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        if self._proc is not None:
            return
        self._broken = None
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "stalwart.checkpoint._persist_worker", str(self.config.nice)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        if not ready.startswith("{"):
            raise CheckpointError("the persister process failed to start; see its stderr above")
        self._reader = threading.Thread(
            target=self._read,
            args=(self._proc.stdout,),
            name="stalwart-persist-reader",
            daemon=True,
        )
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        """Deliver replies until the process's output ends; then, and on any error here,
        fail every pending save (a future left pending would block its waiter forever)."""
        reason = "the persister process exited; the save did not commit"
        try:
            for line in stream:
                self._deliver(json.loads(line))
        except Exception as err:
            reason = f"a reply of the persister process could not be read ({err}); not committed"
        finally:
            with self._lock:  # under the lock: submit() checks _broken under it too
                self._broken = reason
                pending, self._futures = self._futures, {}
            for fut in pending.values():
                fut.set_exception(CheckpointError(reason))

    def _deliver(self, reply: dict[str, Any]) -> None:
        with self._lock:
            fut = self._futures.pop(int(reply.get("id", -1)), None)
        if fut is None:
            return
        if reply.get("ok"):
            fut.set_result(
                PersistResult(
                    step=int(reply["step"]),
                    written_bytes=int(reply["written_bytes"]),
                    total_bytes=int(reply["total_bytes"]),
                    seconds=float(reply["seconds"]),
                    committed=bool(reply["committed"]),
                    raw=reply,
                )
            )
        else:
            kind = str(reply.get("kind"))
            msg = str(reply.get("error"))
            err: Exception
            if kind == "DiskFullError":
                err = DiskFullError(28, msg)
            elif kind == "FencedError":
                err = FencedError(msg)
            else:
                err = _ERRORS.get(kind, CheckpointError)(f"persist failed: {msg}")
            fut.set_exception(err)

    def submit(self, request: dict[str, Any]) -> Future[PersistResult]:
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        fut: Future[PersistResult] = Future()
        with self._lock:
            if self._broken is not None:
                raise CheckpointError(f"{self._broken}; restart the job's persister")
            self._next += 1
            rid = self._next
            self._futures[rid] = fut
        payload = dict(request, op="persist", id=rid, chunk_bytes=self.config.chunk_bytes)
        try:
            self._proc.stdin.write(json.dumps(payload) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            with self._lock:
                self._futures.pop(rid, None)
            raise CheckpointError(
                "the persister process is gone; restart the job's persister"
            ) from err
        return fut

    def close(self, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
