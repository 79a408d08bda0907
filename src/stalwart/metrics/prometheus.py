"""A small Prometheus exporter: the live figures over HTTP in the text exposition format.

Why hand-written rather than prometheus_client: a dozen gauges and counters in the text
format (version 0.0.4) is a page of code with no dependency and no global registry, so
several exporters (one per agent in a test) never collide. It binds 127.0.0.1 unless
told otherwise (the design's rule: servers bind loopback by default).

Names follow Prometheus conventions: ``stalwart_`` prefix, base units (seconds, bytes),
``_total`` on counters, ``_ratio`` on ratios. docs/goodput.md lists every metric.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from stalwart.metrics.live import LiveFigures, LiveSnapshot
from stalwart.metrics.serve import PathServer

__all__ = ["CONTENT_TYPE", "METRICS", "MetricsExporter", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, type, help, LiveSnapshot attribute (None-valued samples are left out)
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("stalwart_step", "gauge", "Last completed training step.", "step"),
    ("stalwart_steps_total", "counter", "Training steps completed, redone ones included.",
     "steps_total"),
    ("stalwart_steps_per_second", "gauge", "Recent training throughput.", "steps_per_s"),
    ("stalwart_elapsed_seconds", "gauge", "Wall time since the run started.", "elapsed_s"),
    ("stalwart_step_busy_seconds_total", "counter",
     "Time spent computing training steps, lost ones included.", "busy_s"),
    ("stalwart_lost_seconds_total", "counter",
     "Step time thrown away by rollbacks (work to be redone).", "lost_s"),
    ("stalwart_lost_steps_total", "counter", "Steps thrown away by rollbacks.", "lost_steps"),
    ("stalwart_ettr_ratio", "gauge",
     "Effective training time ratio so far: productive step time over wall time.", "ettr"),
    ("stalwart_incidents_total", "counter", "Faults seen (injected or detected).", "incidents"),
    ("stalwart_recovering", "gauge", "1 while the job is recovering from a fault.",
     "recovering"),
    ("stalwart_last_rto_seconds", "gauge",
     "Latest recovery time: first fault of the outage to the first step after it.",
     "last_rto_s"),
    ("stalwart_last_detection_latency_seconds", "gauge",
     "Latest detector latency: fault to detection.", "last_detection_s"),
    ("stalwart_world_size", "gauge", "Current number of ranks.", "world_size"),
    ("stalwart_generation", "gauge", "Current job generation.", "generation"),
    ("stalwart_checkpoints_total", "counter", "Snapshots taken.", "checkpoints"),
    ("stalwart_checkpoint_stall_seconds_total", "counter",
     "Time training was blocked by snapshots.", "stall_s"),
    ("stalwart_checkpoint_persist_seconds_total", "counter",
     "Time spent persisting checkpoints in the background.", "persist_s"),
    ("stalwart_checkpoint_persisted_bytes_total", "counter",
     "Bytes written by committed persists.", "persisted_bytes"),
    ("stalwart_checkpoint_persists_total", "counter",
     "Persists finished, by result.", "persists"),
    ("stalwart_restores_total", "counter", "State restores.", "restores"),
    ("stalwart_restore_seconds_total", "counter", "Time spent restoring state.", "restore_s"),
    ("stalwart_stragglers_total", "counter",
     "Ranks declared stragglers: computing persistently slower than the others.", "stragglers"),
    ("stalwart_probe_ok", "gauge",
     "A node health probe's last reading: 1 healthy, 0 failing (skipped probes absent).",
     "probes"),
    ("stalwart_probe_failures_total", "counter",
     "Node health probe readings that started failing.", "probe_failures"),
    ("stalwart_preflight_seconds", "gauge",
     "Wall time of the latest preflight node check.", "preflight_s"),
    ("stalwart_preflight_ok", "gauge",
     "The preflight node check's verdict per node: 1 fit, 0 unfit (blocklisted).", "preflight"),
    ("stalwart_sdc_checks_total", "counter",
     "DDP replica digest checks that every replica passed.", "sdc_checks"),
    ("stalwart_sdc_last_check_step", "gauge",
     "The newest step whose replica digests all agreed.", "sdc_last_check_step"),
    ("stalwart_sdc_detections_total", "counter",
     "DDP replica digest mismatches (silent data corruption on a minority).",
     "sdc_detections"),
    ("stalwart_numeric_faults_total", "counter",
     "NaN, inf or spiking logged losses (each step and action once).", "numeric_faults"),
)  # fmt: skip


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _labelled(s: LiveSnapshot, attr: str) -> list[tuple[tuple[str, ...], int]]:
    """The per-node samples: (labels, value) of the probes' or the preflight's state."""
    if attr == "probes":
        return [
            ((f'node="{_escape(n)}"', f'probe="{_escape(p)}"', f'device="{_escape(d)}"'), v)
            for n, p, d, v in s.probes
        ]
    return [((f'node="{_escape(m)}"',), v) for m, v in s.preflight]


def render_metrics(s: LiveSnapshot, labels: dict[str, str] | None = None) -> str:
    """The exposition text for one snapshot; ``labels`` are added to every sample."""
    base = [f'{k}="{_escape(v)}"' for k, v in sorted((labels or {}).items())]

    def sample(name: str, value: float, extra: tuple[str, ...] = ()) -> str:
        lab = ",".join([*base, *extra])
        return f"{name}{{{lab}}} {_fmt(value)}" if lab else f"{name} {_fmt(value)}"

    out: list[str] = []
    for name, kind, help_, attr in METRICS:
        if attr == "persists":
            samples = [
                sample(name, s.persists_ok, ('result="ok"',)),
                sample(name, s.persists_failed, ('result="failed"',)),
            ]
        elif attr == "recovering":
            samples = [sample(name, 1 if s.status == "recovering" else 0)]
        elif attr in ("probes", "preflight"):
            samples = [sample(name, v, labels) for labels, v in _labelled(s, attr)]
        else:
            v = getattr(s, attr)
            samples = [] if v is None else [sample(name, v)]
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(out) + "\n"


class MetricsExporter:
    """Serves ``GET /metrics`` from a background thread; :meth:`update` swaps in new
    figures (the agent calls it as events arrive). Use as a context manager or call
    :meth:`start` and :meth:`close`."""

    def __init__(
        self, port: int = 0, host: str = "127.0.0.1", labels: dict[str, str] | None = None
    ) -> None:
        self.host, self.port, self.labels = host, port, dict(labels or {})
        self._body = b"# no figures yet\n"
        self._lock = threading.Lock()
        self.live = LiveFigures()  # fed by emit(); rendered at the next scrape
        self._fed = False
        self._server: PathServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def update(self, snapshot: LiveSnapshot) -> None:
        """Serve these figures from now on (for a caller that keeps its own totals)."""
        body = render_metrics(snapshot, self.labels).encode()
        with self._lock:
            self._body, self._fed = body, False

    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None:
        """Take one event (same arguments as :meth:`EventLog.emit`), so the exporter can
        sit in an :class:`EventTee` or a :class:`LiveFeed` directly."""
        with self._lock:
            self.live.emit(kind, t=t, rank=rank, **fields)
            self._fed = True

    def _current(self) -> bytes:
        with self._lock:
            if self._fed:
                self._body = render_metrics(self.live.snapshot(), self.labels).encode()
                self._fed = False
            return self._body

    def start(self) -> MetricsExporter:
        self._server = PathServer(
            self._answer, self.host, self.port, what="metrics", flag="--metrics-port"
        ).start()
        self.port = self._server.port
        return self

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        if path.split("?", 1)[0] != "/metrics":
            return 404, "text/plain; charset=utf-8", b"only /metrics is served here\n"
        return 200, CONTENT_TYPE, self._current()

    @property
    def serving(self) -> bool:
        """Whether scrapes are answered now (False once closed)."""
        return self._server is not None and self._server.serving

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> MetricsExporter:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()
