"""Where the bench's store process spends its CPU (``STALWART_STORE_PROFILE=FILE``):
cProfile in every thread the store starts, merged at exit into FILE, sorted by the
time inside each function itself (blocking calls, select/recv/waits, are listed too:
read past them)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import threading
from typing import Any

_profiles: list[cProfile.Profile] = []


def _hook(frame: Any, event: str, arg: Any) -> None:
    sys.setprofile(None)
    prof = cProfile.Profile()
    _profiles.append(prof)
    prof.enable()


def start() -> None:
    """Profile every thread started from now on, and this one."""
    threading.setprofile(_hook)
    prof = cProfile.Profile()
    _profiles.append(prof)
    prof.enable()


def dump(path: str) -> None:
    threading.setprofile(None)
    stats: pstats.Stats | None = None
    for prof in list(_profiles):
        try:
            prof.disable()
            stats = pstats.Stats(prof) if stats is None else stats.add(prof)
        except (TypeError, ValueError):
            continue
    if stats is None:
        return
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(45)
    with open(path, "w") as f:
        f.write(f"{len(_profiles)} threads profiled\n")
        f.write(out.getvalue())
