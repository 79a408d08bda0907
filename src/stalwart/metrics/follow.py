"""Follow a run's event log as it grows, and feed the live sinks from it.

Why tail the file rather than hook the agent's ``emit``: the events that matter most
live (``steps``, ``snapshot``, ``restore``, ``recovery_end``) are written by the worker
processes, straight to the shared log; the agent never sees them in memory. Tailing the
one file gives every sink the whole run, from any process, at the cost of one ``read``
per poll.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from stalwart.metrics.events import Event, EventLogError, parse_event
from stalwart.metrics.live import EventSink

__all__ = ["EventFollower", "LiveFeed", "start_live"]


class EventFollower:
    """Returns the events appended to ``path`` since the last :meth:`poll`; a line still
    being written (no newline yet) waits for the next poll. A missing file is empty."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self._tail = b""
        self.problems: list[str] = []

    def poll(self) -> list[Event]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self._tail + chunk
        *lines, self._tail = data.split(b"\n")
        out: list[Event] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                out.append(parse_event(line))
            except (
                ValueError, KeyError, TypeError, ArithmeticError, RecursionError, EventLogError
            ) as err:  # fmt: skip
                self.problems.append(f"{self.path}: {err}")  # live display: skip, go on
        return out


class LiveFeed:
    """A thread that polls an :class:`EventFollower` every ``interval_s`` and hands each
    new event to every sink (a :class:`ConsoleProgress`, a :class:`MetricsExporter`, a
    :class:`LiveFigures`): ``LiveFeed(RUN_DIR/events.jsonl, exporter, console).start()``.
    :meth:`close` feeds what is left, then stops and joins the thread."""

    def __init__(
        self, path: str, *sinks: EventSink, interval_s: float = 0.5, owned: tuple[Any, ...] = ()
    ) -> None:
        self.follower = EventFollower(path)
        self.sinks = sinks
        self.owned = owned  # closed (their close()) after the last pump
        self.errors: list[str] = []  # the first few failures of sinks, kept for the caller
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def pump(self) -> int:
        """Feed what is new now; returns how many events."""
        with self._lock:
            events = self.follower.poll()
            for e in events:
                for s in self.sinks:
                    try:
                        s.emit(e.kind, t=e.t, rank=e.rank, **e.fields)
                    except Exception as err:  # a display must never stop the others
                        if len(self.errors) < 10:
                            self.errors.append(f"{type(s).__name__}: {err!r}")
            return len(events)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.pump()

    def start(self) -> LiveFeed:
        self._thread = threading.Thread(target=self._run, name="stalwart-live-feed", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.pump()
        for thing in self.owned:
            thing.close()
        self.owned = ()

    def __enter__(self) -> LiveFeed:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


def start_live(
    run_dir: str,
    *,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    console: bool = True,
    total_steps: int | None = None,
    labels: dict[str, str] | None = None,
    interval_s: float = 0.5,
) -> LiveFeed:
    """What ``stalwart run`` needs in one call: a console progress line (stderr) and, with
    ``metrics_port`` (0 picks a free one), a Prometheus endpoint, both fed from
    ``RUN_DIR/events.jsonl``. ``close()`` on the result feeds the last events and stops
    everything it started."""
    from stalwart.metrics.console import ConsoleProgress
    from stalwart.metrics.events import EVENTS_FILE
    from stalwart.metrics.prometheus import MetricsExporter

    sinks: list[Any] = []
    if metrics_port is not None:
        sinks.append(MetricsExporter(metrics_port, metrics_host, labels).start())
    if console:
        sinks.append(ConsoleProgress(total_steps=total_steps))
    path = os.path.join(run_dir, EVENTS_FILE)
    return LiveFeed(path, *sinks, interval_s=interval_s, owned=tuple(sinks)).start()
