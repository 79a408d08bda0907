"""How an agent's run ends when it does not end well: one exception per outcome.

The loop (agent/agent.py) maps each to the run's status and exit code: a job that
cannot go on (1), a node that cordoned itself (3), SIGTERM (143).
"""

from __future__ import annotations

import contextlib
from typing import Any, NoReturn, Protocol

from stalwart.errors import StalwartError

__all__ = ["Cordoned", "RunFailed", "Terminated", "end_with_verdict"]


class RunFailed(StalwartError):
    """The job cannot go on (its message is the one line the user reads)."""


class Cordoned(StalwartError):
    """This node failed too often: it leaves like a lost node, its ranks move."""


class Terminated(KeyboardInterrupt):
    """SIGTERM: the run ends like after Ctrl-C, with 143 (128 + SIGTERM)."""


class _Publisher(Protocol):
    def publish(self, key: str, record: dict[str, Any]) -> None: ...


def end_with_verdict(cluster: _Publisher, say: Any, line: str) -> NoReturn:
    """End the job (every node: the verdict is published) with one line."""
    with contextlib.suppress(Exception):
        cluster.publish("verdict", {"line": line})
    say(line)
    raise RunFailed(line)
