"""Where a run's event log is, for the report: a run directory or the log itself, and
the one-line error when the path given cannot be one."""

from __future__ import annotations

import os
import stat

from stalwart.errors import StalwartError
from stalwart.metrics.events import EVENTS_FILE

__all__ = ["ReportError", "log_path"]


class ReportError(StalwartError):
    """The run directory holds no usable event log."""


def log_path(run_dir: str) -> str:
    """The event log of ``run_dir`` (a run directory, or the log itself); one line naming
    the path (cut to 120 characters) and why when it cannot be reached (a symlink loop, a
    name too long, a URL: only local paths are read)."""
    shown = run_dir if len(run_dir) <= 120 else f"{run_dir[:120]}... ({len(run_dir)} characters)"
    try:
        mode = os.stat(run_dir).st_mode
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        why = getattr(err, "strerror", None) or "not a usable path"
        raise ReportError(
            f"{shown}: no such run directory ({why}); pass the directory of a `stalwart run`"
        ) from err
    if stat.S_ISDIR(mode):
        return os.path.join(run_dir, EVENTS_FILE)
    if stat.S_ISREG(mode):
        return run_dir
    raise ReportError(f"{shown}: not a run directory; pass the directory of a `stalwart run`")
