"""The live progress display of ``stalwart run``: one updating line, not a log flood.

On a terminal the status line is rewritten in place (at most every ``refresh_s`` of
event time) and notable events (a fault, a resumption with its RTO, the end) are printed
as lines above it. Elsewhere (a pipe, a CI log) there is no carriage-return animation:
notable events, plus a progress line every ``plain_every_s``. Refreshes are paced by the
events' own timestamps, so what is printed depends only on the events fed.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from stalwart.logs import terminal_safe
from stalwart.metrics.live import LiveFigures, LiveSnapshot

__all__ = ["ConsoleProgress", "domain_text", "format_status"]


def domain_text(domain: Any) -> str:
    """A fault domain as words: ``{"rank": 1, "node": 0}`` -> ``rank 1 (node 0)``."""
    if not isinstance(domain, dict) or not domain:
        return str(domain or "-")
    parts = [f"{k} {v}" for k, v in domain.items()]
    return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


def _s(x: float | None, fmt: str = ".1f", unit: str = "s") -> str:
    return "-" if x is None else f"{x:{fmt}}{unit}"


def format_status(s: LiveSnapshot, total_steps: int | None = None) -> str:
    """``step 120/1000  3.2 steps/s  ETTR 96.1%  incidents 1  last RTO 4.2s``"""
    step = "-" if s.step is None else str(s.step)
    if total_steps is not None:
        step += f"/{total_steps}"
    parts = [
        f"step {step}",
        f"{_s(s.steps_per_s, '.2f', '')} steps/s",
        f"ETTR {_s(None if s.ettr is None else 100 * s.ettr, '.1f', '%')}",
        f"incidents {s.incidents}",
        f"last RTO {_s(s.last_rto_s)}",
    ]
    if s.world_size is not None:
        parts.append(f"world {s.world_size}")
    if s.status in ("recovering", "starting"):
        parts.append(f"[{s.status}]")
    return "  ".join(parts)


class ConsoleProgress:
    """Feed it events (same arguments as :meth:`EventLog.emit`); call :meth:`close` at the
    end. ``tty=None`` asks the stream."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        total_steps: int | None = None,
        refresh_s: float = 0.25,
        plain_every_s: float = 30.0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", bool)())
        self.total_steps = total_steps
        self.refresh_s = refresh_s
        self.plain_every_s = plain_every_s
        self.live = LiveFigures()
        self._last_draw: float | None = None
        self._line_len = 0
        self._rto_seen: float | None = None

    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None:
        self.live.emit(kind, t=t, rank=rank, **fields)
        snap = self.live.snapshot()
        note = self._notable(kind, fields, snap)
        if note is not None:
            self._print(note)
        every = self.refresh_s if self.tty else self.plain_every_s
        due = self._last_draw is None or snap.t - self._last_draw >= every
        if kind == "run_end":
            return  # the end line above already says it all
        if (self.tty and (due or note is not None)) or (not self.tty and due and kind == "steps"):
            self._draw(snap)

    def _notable(self, kind: str, f: dict[str, Any], s: LiveSnapshot) -> str | None:
        if kind == "fault_injected":
            return f"fault injected: {f['fault']} {domain_text(f['domain'])}"
        if kind == "fault_detected":
            where = domain_text(f["domain"])
            return f"fault detected: {f['fault']} {where} after {f['latency_s']:.2f}s"
        if kind == "recovery_begin":
            return f"recovering ({f['strategy']}, generation {f['generation']})"
        if kind == "steps" and s.last_rto_s is not None and s.last_rto_s != self._rto_seen:
            self._rto_seen = s.last_rto_s
            return f"training resumed at step {f['first_step']}: RTO {s.last_rto_s:.2f}s"
        if kind == "resize":
            return f"world size now {f['world_size']}"
        if kind == "run_end":
            return f"run ended: {f['status']}  " + format_status(s, self.total_steps)
        return None

    def _print(self, line: str) -> None:
        if self.tty and self._line_len:
            self.stream.write("\r\x1b[K")
            self._line_len = 0
        self.stream.write(terminal_safe(line) + "\n")
        self.stream.flush()

    def _draw(self, s: LiveSnapshot) -> None:
        self._last_draw = s.t
        line = terminal_safe(format_status(s, self.total_steps))
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self._line_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the status line (a terminal's cursor goes to a fresh line)."""
        if self.tty and self._line_len:
            self.stream.write("\n")
            self.stream.flush()
            self._line_len = 0
