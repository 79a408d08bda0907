"""Which modules of a training script the zygote imports before it forks any worker.

Why: a replacement worker is forked from the zygote, so whatever the zygote imported is
already in the replacement's memory. torch is imported there anyway; a real script also
imports transformers, datasets, its logging library..., and importing transformers alone
costs about a second here: every replacement paid it again. So the zygote imports the
script's top-level ``import``/``from`` modules too, read from the script's source with
:mod:`ast` (the script itself is never run).

What is preloaded: top-level imports (also inside a top-level ``try``/``if``) of modules
found outside the script's directory and the working directory (installed packages and
the standard library: the script's own modules may run its code at import, and may be
edited between restarts; agent/processes/_local_preload.py imports those that only define
things). ``from m import a, b`` also reads ``m.a`` and ``m.b``, which
loads the lazy submodules of packages such as transformers. Each import gets a time
limit (judged by the CPU it uses: a waiting import is stopped, a busy one goes on), a
failing one is skipped (the worker will import it itself and fail there, as it
would without stalwart), and the zygote checks that the imports ran no torch op and
started no thread (either would make forked workers deadlock) before it forks anything.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

from stalwart.agent.processes._proc import read_cpu

__all__ = [
    "PreloadResult",
    "fork_probe",
    "local_roots",
    "preload",
    "script_imports",
    "threads",
]

_PER_IMPORT_S = 20.0  # one import that uses no CPU for this long is abandoned (waits)
_CAP_WINDOWS = 15  # ... and one that computes, after this many of those windows
_TOTAL_S = 60.0  # no import starts after this much time spent preloading


def script_imports(path: str) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` for each absolute top-level import of the script at ``path``
    (``names``: what ``from module import ...`` reads; empty for ``import module``).
    A script that does not parse has none (Python reports its syntax error itself)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return []
    out: dict[str, list[str]] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out.setdefault(alias.name, [])
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module or node.module == "__future__":
                    continue
                names = out.setdefault(node.module, [])
                names.extend(a.name for a in node.names if a.name != "*")
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    return [(m, tuple(dict.fromkeys(n))) for m, n in out.items()]


@dataclass
class PreloadResult:
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # the script's own, or not found
    failed: list[str] = field(default_factory=list)  # "module: first line of the error"
    seconds: float = 0.0


class _Timeout(BaseException):
    """Not an ``Exception``: a library's ``except Exception`` (transformers' lazy modules
    wrap a failed submodule import in one) or the lazy attribute's own suppression below
    would swallow it, leaving the import half done in ``sys.modules``."""


class _Limit:
    """The time limit of one import, judged by this process's CPU time: a SIGALRM every
    ``window_s`` stops the import in a window in which it used almost no CPU (it waits:
    a network call, a lock), or after ``_CAP_WINDOWS`` windows. An import that computes
    goes on: on a loaded machine transformers' took 30-100 s of wall time (2 cores, load
    26-38), and a preload dropped for it made every replacement import it again."""

    def __init__(self, window_s: float) -> None:
        self.window_s, self.cpu, self.t0, self.windows = window_s, 0.0, 0.0, 0
        self.stuck = False

    def arm(self) -> None:
        self.cpu, self.t0, self.windows = time.process_time(), time.monotonic(), 0
        self.stuck = False
        signal.setitimer(signal.ITIMER_REAL, self.window_s, self.window_s)

    def why(self) -> str:
        spent = time.monotonic() - self.t0
        return f"import took over {spent:.0f}s" + (" without using the CPU" if self.stuck else "")

    def __call__(self, _sig: int, _frame: FrameType | None) -> None:
        cpu = time.process_time()
        used, self.cpu = cpu - self.cpu, cpu
        self.windows += 1
        self.stuck = used < min(0.2, 0.01 * self.window_s)  # under 1% of a core
        if self.stuck or self.windows >= _CAP_WINDOWS:
            raise _Timeout


def _forget(before: set[str]) -> None:
    """Drop the modules an interrupted import left behind. An import stopped midway
    (the alarm) leaves the submodules it had finished in ``sys.modules``, bound to
    package objects Python already discarded: every worker forked from the zygote then
    imports the package again over them and fails (``partially initialized module
    'lightning.fabric' has no attribute 'accelerators'``). Without them, the worker
    imports the package whole, as without a preload."""
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def _read_lazy(module: object, name: str) -> None:
    """``from m import name``: read ``m.name``. One that fails to import (a missing
    optional dependency) is skipped, and the modules its attempt left are dropped."""
    before = set(sys.modules)
    try:
        getattr(module, name)
    except Exception:
        _forget(before)


def _installed_roots() -> list[str]:
    """Where installed packages and the standard library live (site-packages, the
    interpreter's library directories)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    found = [paths.get(k, "") for k in ("purelib", "platlib", "stdlib", "platstdlib")]
    with contextlib.suppress(AttributeError):  # a virtualenv's old site.py lacks them
        found += [*site.getsitepackages(), site.getusersitepackages()]
    return [os.path.realpath(p) for p in found if p]


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def _local(origin: str | None, roots: list[str], installed: list[str]) -> bool:
    """The module at ``origin`` is the script's own: under ``roots`` and not installed (a
    virtual environment inside the working directory, as ``python -m venv .venv`` in a
    project makes, holds installed packages, not the script's code)."""
    if not origin or origin in ("built-in", "frozen"):
        return False
    path = os.path.realpath(origin)
    return _under(path, roots) and not _under(path, installed)


def preload(
    items: list[tuple[str, tuple[str, ...]]],
    *,
    local_roots: list[str],
    per_import_s: float = _PER_IMPORT_S,
    total_s: float = _TOTAL_S,
) -> PreloadResult:
    """Import ``items`` (from :func:`script_imports`) in this process, skipping the
    modules found under ``local_roots`` (the script's own code). Runs in the zygote's
    main thread (the time limit is a SIGALRM: :class:`_Limit`)."""
    roots = [os.path.realpath(r) for r in local_roots if r]
    installed = _installed_roots()
    res = PreloadResult()
    t0 = time.monotonic()
    limit = _Limit(per_import_s)
    old = signal.signal(signal.SIGALRM, limit)
    try:
        for mod, names in items:
            if time.monotonic() - t0 > total_s:
                res.failed.append(f"{mod}: not tried (preloading took over {total_s:.0f}s)")
                continue
            top = mod.split(".")[0]
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            if spec is None or _local(spec.origin, roots, installed) or top == "__main__":
                res.skipped.append(mod)
                continue
            if mod in sys.modules and not names:
                continue  # already there (torch, the standard library's basics)
            limit.arm()
            before = set(sys.modules)
            try:
                module = importlib.import_module(mod)
                for name in names:  # lazy attributes (transformers' models)
                    _read_lazy(module, name)
                res.imported.append(mod)
            except _Timeout:
                res.failed.append(f"{mod}: {limit.why()}")
                _forget(before)
            except BaseException as err:  # SystemExit too: never end the zygote
                first = (str(err).splitlines() or [""])[0]
                res.failed.append(f"{mod}: {type(err).__name__}: {first}"[:200])
                _forget(before)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    res.seconds = time.monotonic() - t0
    return res


def threads() -> dict[str, str]:
    """This process's OS threads, id to name (an OpenMP pool or a library's thread shows
    here, named as the library named it)."""
    out: dict[str, str] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        import threading

        return {str(t.ident): t.name for t in threading.enumerate()}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                out[tid] = f.read().strip()
        except OSError:
            continue  # it ended meanwhile
    return out


def _probe_op(threads: int) -> bool:
    """In the probe's child: a small torch op on ``threads`` intra-op threads."""
    import torch

    torch.set_num_threads(max(1, threads))
    a = torch.ones(256, 256)
    return float((a @ a).sum()) > 0


def fork_probe(
    threads: int, *, stall_s: float = 5.0, cpu_s: float = 10.0, wall_s: float = 600.0
) -> bool:
    """Fork a child that runs a small torch op with ``threads`` intra-op threads: False
    when it deadlocks (this process ran a torch op: forked workers would deadlock too).
    The zygote itself never runs the op.

    Deadlocked means asleep, its CPU time standing still for ``stall_s`` (the child waits
    for an OpenMP pool that was not forked with it), or ``cpu_s`` of CPU spent without
    finishing, or ``wall_s`` passed. A child that is only slow (a loaded machine: runnable,
    or its CPU time growing) is waited for: a wall-clock limit alone (10 s before) judged
    slow children deadlocked under load, and the zygote then dropped a safe preload."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if _probe_op(threads) else 1
        finally:
            os._exit(code)
    t0 = last = time.monotonic()
    cpu0 = -1.0
    while time.monotonic() - t0 < wall_s:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        now, seen = time.monotonic(), read_cpu(pid)
        if seen is not None:
            state, cpu = seen
            if cpu > cpu_s:
                break
            if cpu != cpu0 or state != "S":  # computing, runnable or in I/O: progress
                cpu0, last = cpu, now
            elif now - last > stall_s:
                break
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def local_roots(script: str) -> list[str]:
    """Where the script's own modules live: its directory and the working directory."""
    return [os.path.dirname(os.path.abspath(script)), os.getcwd()]
