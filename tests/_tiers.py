"""The two tiers of the suite: which tests start a process (``e2e``), and the guard
that keeps the rest (the unit tier, ``make check``) from starting one unmarked.

A test is ``e2e`` when it, a fixture it uses, or a helper either calls (followed through
the tests' own modules: tests/agent/_launch.py, tests/coordinator/etcd_server.py, ...)
names ``subprocess``, ``multiprocessing``, ``torch.multiprocessing`` or ``os.fork``: that
rule (``starts_process``) marks the job tests, the etcd and Slurm tests and the
multi-process worlds without a mark in each file (``PROCESS_PARAMS``: a parametrized
fixture that starts a process for some parameters only). What it cannot see, a process
started inside stalwart's own code, is marked where the test is: ``e2e`` for a job or a
zygote, or ``process`` for a short-lived helper of the library's own (the checkpoint
persister, DataLoader workers, a fresh interpreter that checks what an import loads),
which keeps the test in the unit tier. The guard (``ProcessGuard``) finds any it missed:
in a test with neither mark every process start raises ``ProcessInUnitTestError`` and
fails the test.

When tests/ splits into unit/ and e2e/ folders, the ``e2e`` tests are the e2e folder.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["PROCESS_PARAMS", "ProcessGuard", "ProcessInUnitTestError", "starts_process"]

TESTS = Path(__file__).resolve().parent

_PROCESS_MODULES = frozenset(
    {"subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process"}
)
_OS_STARTS = frozenset({"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen"})

PROCESS_PARAMS: dict[str, frozenset[str]] = {
    # tests/coordinator/conftest.py: only the etcd backends start a server process
    "backend": frozenset({"etcd", "etcd-tls"}),
    # tests/checkpoint/test_storage.py: only the s3 storage starts a server (moto)
    "storage": frozenset({"s3"}),
}
"""A parametrized fixture that starts a process for some of its parameters only."""

# short-lived probes that libraries run on their own (matplotlib's font cache asks
# fc-list, ctypes.util.find_library asks ldconfig/gcc): not a process the test starts
_LIBRARY_PROBES = frozenset({"fc-list", "ldconfig", "ldconfig.real", "gcc", "cc", "ld", "uname"})


class ProcessInUnitTestError(AssertionError):
    """A test without the ``e2e`` mark started a process."""


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _ours(obj: object) -> bool:
    """Defined in the tests' own modules (a helper worth following)."""
    mod = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(mod, "__file__", None)
    if file is None or mod is sys.modules[__name__]:  # the guard itself starts nothing
        return False
    return Path(file).resolve().is_relative_to(TESTS)


def _functions(obj: object) -> Iterator[types.FunctionType]:
    if isinstance(obj, types.FunctionType):
        yield inspect.unwrap(obj)  # type: ignore[misc]
    elif isinstance(obj, type):
        for value in vars(obj).values():
            inner = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(inner, property):
                inner = inner.fget
            if isinstance(inner, types.FunctionType):
                yield inner


def starts_process(fn: Callable[..., Any], _seen: set[int] | None = None) -> bool:
    """Whether ``fn`` (a test or fixture function) names a way to start a process, itself
    or through a helper defined in tests/."""
    seen = set() if _seen is None else _seen
    inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None) or fn
    for func in _functions(inner):
        if id(func.__code__) in seen:
            continue
        seen.add(id(func.__code__))
        names = set(_names(func.__code__))
        if "os" in names and names & _OS_STARTS:
            return True
        for name in names:
            value = func.__globals__.get(name)
            if value is None:
                continue
            if isinstance(value, types.ModuleType):
                if value.__name__ in _PROCESS_MODULES:
                    return True
                continue
            if getattr(value, "__module__", None) in _PROCESS_MODULES:
                return True  # from subprocess import Popen, from torch.multiprocessing import spawn
            if _ours(value) and starts_process(value, seen):
                return True
    return False


class ProcessGuard:
    """While active, every process start in this process raises (and is remembered)."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.started: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def _refuse(self, what: str) -> ProcessInUnitTestError:
        self.started.append(what)
        return ProcessInUnitTestError(
            f"{self.test} started a process ({what}) but is marked neither e2e nor process: "
            "mark it, or keep it in one process (tests/_tiers.py)"
        )

    def _patch(self, owner: object, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        self._undo.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> ProcessGuard:
        guard = self

        def execute_child(original: Any) -> Any:
            def wrapped(popen: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> Any:
                argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
                program = os.path.basename(os.fsdecode(argv[0]).split()[0]) if argv else ""
                if program in _LIBRARY_PROBES:
                    return original(popen, args, *rest, **kw)
                raise guard._refuse(f"subprocess {program}")

            return wrapped

        def refuse(what: str) -> Callable[[Any], Any]:
            def make(_original: Any) -> Any:
                def wrapped(*_args: Any, **_kw: Any) -> Any:
                    raise guard._refuse(what)

                return wrapped

            return make

        self._patch(subprocess.Popen, "_execute_child", execute_child)
        self._patch(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
        for name in sorted(_OS_STARTS - {"popen"}):  # os.popen goes through subprocess
            self._patch(os, name, refuse(f"os.{name}"))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()
