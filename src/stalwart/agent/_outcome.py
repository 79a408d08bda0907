"""How an agent's run ends when it does not end well: one exception per outcome.

The loop (agent/agent.py) maps each to the run's status and exit code: a job that
cannot go on (1), a node that cordoned itself (3), SIGTERM (143).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn, Protocol

from stalwart.agent.cluster._cluster import NodeFenced
from stalwart.coordinator import StoreUnavailableError
from stalwart.errors import FencedError, StalwartError
from stalwart.logs import terminal_safe

__all__ = [
    "ENDINGS",
    "Cordoned",
    "Ending",
    "Handlers",
    "RunFailed",
    "Terminated",
    "catch_sigterm",
    "end_with_verdict",
    "ending",
    "ignore_signals",
    "quietly",
    "signals_of_a_run",
]


class RunFailed(StalwartError):
    """The job cannot go on (its message is the one line the user reads)."""


class Cordoned(StalwartError):
    """This node failed too often: it leaves like a lost node, its ranks move."""


class Terminated(KeyboardInterrupt):
    """SIGTERM: the run ends like after Ctrl-C, with 143 (128 + SIGTERM)."""


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated


Handlers = dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None]
"""The process's own SIGINT and SIGTERM handlers, as they were before a run."""


def catch_sigterm() -> Handlers | None:
    """SIGTERM ends the run as :class:`Terminated` (only the main thread can set a
    handler: an agent run in a thread, as in tests, keeps the default); returns the
    handlers it found, for :func:`restore_signals` (None: not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _terminate)
    return saved


def ignore_signals(saved: Handlers | None) -> None:
    """Once the run ended: a second Ctrl-C or SIGTERM must not cut the teardown short
    (it would leave shared memory and workers behind)."""
    for sig in saved or {}:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def signals_of_a_run() -> Iterator[Handlers | None]:
    """SIGTERM ends the run while it runs (:func:`catch_sigterm`; what it yields goes to
    :func:`ignore_signals` for the teardown); at the exit, the handlers the process had
    before the run (an agent run in a longer-lived process, a test suite's or a
    notebook's, gives Ctrl-C back)."""
    saved = catch_sigterm()
    try:
        yield saved
    finally:
        for sig, handler in (saved or {}).items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class _Publisher(Protocol):
    def publish(self, key: str, record: dict[str, Any]) -> None: ...


def end_with_verdict(cluster: _Publisher, line: str) -> NoReturn:
    """End the job (every node: the verdict is published) with one line: the command's
    own output (printed), not a diagnostic."""
    with contextlib.suppress(Exception):
        cluster.publish("verdict", {"line": line})
    print(f"stalwart: {terminal_safe(line)}", file=sys.stderr, flush=True)
    raise RunFailed(line)


@dataclass(frozen=True)
class Ending:
    status: str  # run_end's status
    code: int  # the agent's exit code
    reason: str
    goodbye: bool = True  # False: this node leaves like a lost node (its ranks move)


ENDINGS = (NodeFenced, Cordoned, RunFailed, KeyboardInterrupt, StoreUnavailableError, FencedError)
"""What ends the loop early; :func:`ending` says how (a coordinator that stopped
answering a joined node, a bump refused for its lease: fenced, agent/cluster/_fencing.py)."""


def ending(err: BaseException) -> Ending:
    if isinstance(err, NodeFenced):
        return Ending("fenced", 3, str(err), goodbye=False)
    if isinstance(err, Cordoned):
        return Ending("cordoned", 3, str(err), goodbye=False)
    if isinstance(err, Terminated):
        return Ending("terminated", 143, "SIGTERM")
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C
        return Ending("interrupted", 130, "SIGINT (Ctrl-C)")
    return Ending("failed", 1, str(err))


def quietly(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` for a teardown step whose failure must not stop the next ones."""

    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    return run
