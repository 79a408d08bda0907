"""Start a launch as a terminal's job would be: taking Ctrl-C.

A suite started in the background by a non-interactive shell (``make test &``, a CI
runner's script) runs with SIGINT ignored, and a child inherits that: a test's Ctrl-C
(SIGINT to the launch's process group) would never reach the launch it tests."""

from __future__ import annotations

import signal

__all__ = ["ctrl_c_as_in_a_terminal"]


def ctrl_c_as_in_a_terminal() -> None:
    """``preexec_fn`` of a launch a test will interrupt: SIGINT back to its default (in
    the child, before its exec; Python then installs its KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
