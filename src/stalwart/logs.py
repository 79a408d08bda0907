"""Diagnostics: one logger per part, one line format, installed by the entry points.

Two kinds of text reach a user's terminal, and they are kept apart on purpose:

* **what a command says** — ``stalwart: error: ...`` (a user error, one line), a verdict,
  ``stalwart report``'s summary, ``stalwart simulate``'s table. Those are the command's
  output: they are printed where they are made and their wording is part of the CLI.
* **diagnostics** — what a part notices while it works (a rank crashed and in how many
  ms, a peer refused, a replica was not sent). Those go through :mod:`logging`, so a
  program that embeds stalwart (a notebook, a script under its own launcher) can route,
  filter or silence them per part (``logging.getLogger("stalwart.transfer")``) like any
  library's, and a test can read them with ``caplog`` instead of parsing stderr.

A diagnostic line reads ``stalwart: <part>: <message>``, with the level spelled out when
it is not INFO (``stalwart: coordinator: warning: ...``). The part is the package that
spoke (``agent``, ``runtime``, ``coordinator``, ``transfer``...): the agent and every
worker of a node share one stderr, and the part says which side of the agent-to-worker
line a message comes from. The message is passed through
:func:`terminal_safe`: diagnostics quote peers' addresses, file
contents and user exceptions, and none of those may move a terminal's cursor or forge a
line (a newline is written as ``\\n``). A traceback (``log.exception``, an internal error,
i.e. a bug) is kept as it is, below the line.

Nothing here runs at import (house rule: no side effects at import). The ``stalwart``
command installs the handler when it starts (:func:`install`); a worker installs it in
``stalwart.init()`` through :func:`install_unless_configured`, which leaves a script
that configured :mod:`logging` itself alone (our records reach its handlers by
propagation, so nothing is printed twice). Until then stalwart's records fall to
Python's last-resort handler (WARNING and above, bare message), as any library's do.
"""

from __future__ import annotations

import logging
import re
import sys

__all__ = [
    "ROOT",
    "DiagnosticFormatter",
    "get_logger",
    "install",
    "install_unless_configured",
    "part_of",
    "terminal_safe",
    "uninstall",
]

ROOT = "stalwart"
"""The logger every part's logger sits under: configure this one to configure them all."""


# C0 and C1 controls, DEL, line/paragraph separators and the bidi overrides: a string
# from events.jsonl (any worker, i.e. user code, writes there) must not move the cursor,
# recolour, retitle or reorder what a terminal shows
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: str, *, newlines: bool = False) -> str:
    """``text`` with every control character written as an escape (``ESC`` -> ``\\x1b``),
    so it prints as what it is; ``newlines``: keep ``\\n`` (a multi-line summary)."""
    if newlines:
        return "\n".join(_UNSAFE.sub(_escape, line) for line in text.split("\n"))
    return _UNSAFE.sub(_escape, text)


def part_of(name: str) -> str:
    """The part a logger or module name belongs to: ``stalwart.agent.strategies._elastic`` ->
    ``agent``; ``stalwart`` itself (the top-level package) -> ``stalwart``."""
    parts = name.split(".")
    if parts[0] != ROOT:
        raise ValueError(
            f"{name!r} is not a stalwart module: pass the module's __name__ "
            f"(e.g. get_logger(__name__) inside src/stalwart/)"
        )
    return parts[1] if len(parts) > 1 else ROOT


def get_logger(name: str) -> logging.Logger:
    """The logger of the part ``name`` (a module's ``__name__``) belongs to.

    One logger per part, not per module: the part is what a user filters on, and a
    module split or renamed by a refactor must not change where its lines go."""
    part = part_of(name)
    return logging.getLogger(ROOT if part == ROOT else f"{ROOT}.{part}")


class DiagnosticFormatter(logging.Formatter):
    """``stalwart: <part>: [<level>: ]<message>``, terminal-safe, traceback below."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            part = part_of(record.name)
        except ValueError:  # a record from outside stalwart reached our handler
            part = record.name
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        line = f"{ROOT}: {part}: {level}{terminal_safe(record.getMessage())}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info).rstrip("\n")
        return line


class _StderrHandler(logging.Handler):
    """Writes to ``sys.stderr`` as it is at each record, not as it was at install time:
    the zygote's forked workers and pytest's capture replace ``sys.stderr``, and a
    diagnostic must go where the process's stderr goes now."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()  # the agent and its workers interleave: a line whole, at once
        except Exception:
            self.handleError(record)


def _installed() -> _StderrHandler | None:
    for handler in logging.getLogger(ROOT).handlers:
        if isinstance(handler, _StderrHandler):
            return handler
    return None


def install(level: int = logging.INFO) -> None:
    """Print stalwart's diagnostics at ``level`` and above on stderr, one format.

    Idempotent (a worker forked from the agent inherits the agent's handler; a second
    call only sets the level). The handler sits on the ``stalwart`` logger, not the root
    one: stalwart configures its own diagnostics, never the host program's logging."""
    root = logging.getLogger(ROOT)
    root.setLevel(level)
    if _installed() is None:
        handler = _StderrHandler()
        handler.setFormatter(DiagnosticFormatter())
        root.addHandler(handler)


def install_unless_configured(level: int = logging.INFO) -> None:
    """:func:`install`, unless the process's root logger already has a handler: then
    the program owns its logging and stalwart's records reach it by propagation (its
    level and format apply). A handler of ours inherited from a parent process is
    removed in that case: with both, each line would be printed twice."""
    if logging.getLogger().handlers:
        uninstall()
        return
    install(level)


def uninstall() -> None:
    """Remove what :func:`install` added (for a program or test that wants it gone)."""
    root = logging.getLogger(ROOT)
    handler = _installed()
    if handler is not None:
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)
