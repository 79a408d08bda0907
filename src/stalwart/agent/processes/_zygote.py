"""The zygote: a process that imported torch but ran no torch op, forked per worker.

Why: ``import torch`` costs 1.6-3 s here, which alone would exceed the flash recovery
target. A process that has imported torch but not yet run an op can fork, and the child
builds a gloo group at once (an allreduce 40 ms after the fork, measured on a
2-core VM); once an op ran, the OpenMP pool exists and a
forked child deadlocks. So the zygote imports and never computes; every worker, first
start or replacement, is forked from it. It also pre-forks *spares* (children parked on
a pipe until given a rank) and hosts the job's c10d TCPStore in a forked child, because
a store that outlives every worker is what lets survivors build the next generation's
process group.

Protocol (JSON lines): the agent writes requests to fd ``CTL`` and reads replies on fd
``EVT`` (both passed on the command line); stdout/stderr stay the agent's, so a worker
prints where the agent prints. Requests: ``spawn`` {id, spec}, ``prefork`` {id},
``assign`` {pid, spec}, ``store`` {}. Replies: ``ready``, ``spawned`` {id, pid},
``store`` {port}, ``exit`` {pid, rc, t}. ``rc`` is the exit code, or -signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import time
from typing import Any

from stalwart.agent.processes._teardown import exit_code, finish, hold_destroyed_groups
from stalwart.contract.env import WorkerEnv

__all__ = ["error_file", "main", "set_pdeathsig"]

_PR_SET_PDEATHSIG = 1


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Die with ``sig`` when the parent dies (Linux), so nothing outlives its agent."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _send(fd: int, msg: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _run_worker(spec: dict[str, Any], close_fds: list[int]) -> None:
    """In the forked child: become the worker described by ``spec``; never returns.

    The script's globals are held until the process ends: ``python script.py`` runs the
    threads' join and the ``atexit`` handlers *before* it tears down ``__main__``, and the
    teardown itself is what hung here (a DDP model's and its gloo group's destructors, run
    when ``runpy`` dropped the globals, blocked for minutes after the peer had exited).
    Open files the script never closed are flushed instead (agent/processes/_teardown.py)."""
    code = 1
    held: list[object] = []  # the script's globals (or its traceback, which holds them)
    error_line = ""  # where the error's first line goes (the contract's error_line)
    try:
        set_pdeathsig()
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        for fd in close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        log = spec.get("log")
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        contract = _take_environ(spec)
        error_line = contract.error_line
        os.chdir(spec["cwd"])
        argv = list(spec["argv"])
        sys.argv = argv
        path = os.path.abspath(argv[0])  # `python script.py` gives an absolute __file__
        sys.path[0] = os.path.dirname(path)
        from stalwart.agent.processes._local_preload import forget_changed

        forget_changed()  # a preloaded module of the script's edited since: import it anew
        # Python-level SIGINT as in `python script.py` (KeyboardInterrupt, then atexit)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import torch

        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        if contract.progress:
            from stalwart.agent.processes.observe import install

            install(contract.progress, contract.progress_slot)
        hold_destroyed_groups()  # their destructors may hang (agent/processes/_teardown.py)
        import runpy

        try:
            held.append(runpy.run_path(path, run_name="__main__"))
            code = 0
        except SystemExit as exc:
            held.append(exc.__traceback__)
            code = exit_code(exc)
            if exc.code is not None and not isinstance(exc.code, int):
                _error_line(error_line, str(exc.code))
    except BaseException as exc:
        held.append(exc.__traceback__)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        _print_traceback(exc)
        import traceback

        _error_line(error_line, traceback.format_exception_only(type(exc), exc)[-1])
    finally:
        os._exit(finish(code))


def _take_environ(spec: dict[str, Any]) -> WorkerEnv:
    """Become the worker's environment; its contract (a malformed one fails it here)."""
    os.environ.clear()
    os.environ.update(spec["env"])
    errors = spec.get("error_dir")
    if errors:  # torchrun's reply file, named by this process (agent/processes/_env.py)
        os.environ["TORCHELASTIC_ERROR_FILE"] = error_file(
            errors, os.environ.get("RANK", "0"), os.getpid()
        )
    return WorkerEnv.from_environ()


def _print_traceback(exc: BaseException) -> None:
    """The traceback ``python script.py`` prints: from the script's frames on."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name != __file__ and "runpy" not in name:
            break
        tb = tb.tb_next
    with contextlib.suppress(BaseException):
        traceback.print_exception(type(exc), exc, tb)


def error_file(directory: str, rank: str | int, pid: int) -> str:
    """The ``TORCHELASTIC_ERROR_FILE`` of worker ``pid`` (rank ``rank``): the agent reads
    it when the worker fails (``@record`` writes the exception there)."""
    return os.path.join(directory, f"rank{rank}.{pid}.json")


def _error_line(path: str, line: str) -> None:
    """Leave the error's line at ``path``, where the agent looks for it (its crash-loop
    verdict); "": nowhere."""
    if not path:
        return
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(line.strip()[:1000] + "\n")


def _host_store(reply_fd: int, close_fds: list[int], host: str) -> None:
    """In a forked child: serve a c10d TCPStore until the zygote dies."""
    try:
        set_pdeathsig()
        for fd in close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        from stalwart.agent.cluster._address import c10d_store

        port, _store = c10d_store(host)  # bound to the rendezvous host only
        os.write(reply_fd, f"{port}\n".encode())
        os.close(reply_fd)
        while True:
            signal.pause()
    finally:
        os._exit(0)


class _Zygote:
    def __init__(self, ctl: int, evt: int) -> None:
        self.ctl = ctl
        self.evt = evt
        self.buf = b""
        self.spares: dict[str, int] = {}  # spare id -> write end of its assignment pipe
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def own_fds(self) -> list[int]:
        return [self.ctl, self.evt, self.wake_r, self.wake_w, *self.spares.values()]

    def fork_worker(self, spec: dict[str, Any] | None, spare_id: str | None = None) -> int:
        assign_r = -1
        if spare_id is not None:
            assign_r, assign_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            if spec is None:  # a spare: wait for the assignment
                fds = [fd for fd in self.own_fds() if fd != assign_r]
                for fd in [*fds, assign_w]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                data = b""
                while not data.endswith(b"\n"):
                    chunk = os.read(assign_r, 1 << 16)
                    if not chunk:
                        os._exit(0)  # the zygote went away
                    data += chunk
                os.close(assign_r)
                _run_worker(json.loads(data), [])
            assert spec is not None
            _run_worker(spec, self.own_fds())
        if spare_id is not None:
            os.close(assign_r)
            self.spares[str(pid)] = assign_w
        return pid

    def handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "spawn":
            pid = self.fork_worker(msg["spec"])
            _send(self.evt, {"op": "spawned", "id": msg["id"], "pid": pid, "t": time.time()})
        elif op == "prefork":
            pid = self.fork_worker(None, spare_id=str(msg["id"]))
            _send(self.evt, {"op": "spawned", "id": msg["id"], "pid": pid, "t": time.time()})
        elif op == "assign":
            fd = self.spares.pop(str(msg["pid"]))
            os.write(fd, (json.dumps(msg["spec"]) + "\n").encode())
            os.close(fd)
        elif op == "store":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _host_store(w, self.own_fds(), str(msg.get("host", "127.0.0.1")))
            os.close(w)
            with os.fdopen(r) as f:
                port = int(f.readline().strip() or 0)
            _send(self.evt, {"op": "store", "port": port, "pid": pid})

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _send(self.evt, {"op": "exit", "pid": pid, "rc": rc, "t": time.time()})

    def loop(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        poller = select.poll()  # (select() refuses descriptors from 1,024 up)
        poller.register(self.ctl, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll(1000)}
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
            self.reap()
            if self.ctl in ready:
                chunk = os.read(self.ctl, 1 << 20)
                if not chunk:
                    return  # the agent closed the pipe: shut down
                self.buf += chunk
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    if line.strip():
                        self.handle(json.loads(line))


def _preload_script(script: str) -> dict[str, Any]:
    """Import the script's top-level imports (agent/processes/_preload.py); ``note``: why not."""
    from stalwart.agent.processes import _local_preload, _preload

    before = _preload.threads()
    items = _preload.script_imports(script)
    res = _preload.preload(items, local_roots=_preload.local_roots(script))
    local = _local_preload.preload_local(items, script)  # the script's own modules
    out: dict[str, Any] = {
        "imported": res.imported,
        "failed": res.failed,
        "seconds": res.seconds,
        "local": local.imported,
        "local_skipped": local.skipped,
        "note": "",
    }
    if res.imported or local.imported:
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        n = int(threads) if threads.isdigit() else 1
        started = [n for t, n in _preload.threads().items() if t not in before]
        if started:
            out["note"] = f"they started threads ({', '.join(sorted(started))})"
        elif not _preload.fork_probe(n):
            out["note"] = "they ran a torch op (a forked worker would deadlock)"
    return out


def main(argv: list[str]) -> int:
    ctl, evt = int(argv[0]), int(argv[1])
    # the agent ends the run (a terminal's Ctrl-C reaches the whole process group): the
    # zygote and its store host stay until the agent closes the pipe; workers reset these
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    rest = argv[2:]
    script, note = "", ""
    while rest and rest[0].startswith("--"):
        flag, value, rest = rest[0], rest[1], rest[2:]
        if flag == "--script":
            script = value
        elif flag == "--no-script-preload":  # a re-exec after an unsafe preload
            note = value
    preload = [m for m in rest if m]
    set_pdeathsig()
    t0 = time.perf_counter()
    import importlib

    # torch._dynamo is imported by DDP's constructor and costs 1.5 s: pay it here, once
    base = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim"]
    for name in [*base, *preload]:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    report: dict[str, Any] = {"imported": [], "failed": [], "seconds": 0.0, "note": note}
    if script and not note:
        report = _preload_script(script)
        if report["note"]:
            # start again without them: this process is unsafe to fork from now on
            report["imported"] += report["local"]
            os.execv(
                sys.executable,
                [
                    sys.executable,
                    "-m",
                    "stalwart.agent.processes._zygote",
                    str(ctl),
                    str(evt),
                    "--no-script-preload",
                    f"not preloading {', '.join(report['imported'])}: {report['note']}",
                    *preload,
                ],
            )
    import gc

    # every worker inherits these objects: keep its collector from walking (and so
    # copying, page by page) the whole inherited heap
    gc.collect()
    gc.freeze()
    _send(evt, {"op": "ready", "import_s": time.perf_counter() - t0, "preload": report})
    _Zygote(ctl, evt).loop()
    return 0


def _end(rc: int) -> None:
    """End the zygote as its workers end (agent/processes/_teardown.py): stdio flushed, then
    ``os._exit``. Its interpreter teardown would only report what the frozen heap never
    frees: with triton installed, the ``torch._dynamo`` preload imports it and nanobind
    printed some 30 lines of 'leaked' types and functions after every run."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    _end(main(sys.argv[1:]))
