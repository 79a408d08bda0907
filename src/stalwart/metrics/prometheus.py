"""A Prometheus exporter: the live figures over HTTP in the text exposition format.

The exposition is prometheus_client's (``generate_latest`` over a
:class:`CollectorRegistry` of the exporter's own, with a custom collector that turns a
:class:`LiveSnapshot` into metric families): its escaping and number formatting are the
reference ones, and no global registry is used, so several exporters (one per agent in a
test) never collide. The HTTP server is stalwart's bounded one (metrics/serve.py: a cap
on header bytes, a total deadline per request, a connection cap), not
prometheus_client's ``start_http_server``, which has none of them. It binds 127.0.0.1
unless told otherwise (the design's rule: servers bind loopback by default).

Names follow Prometheus conventions: ``stalwart_`` prefix, base units (seconds, bytes),
``_total`` on counters, ``_ratio`` on ratios. docs/goodput.md lists every metric.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stalwart.metrics.live import LiveFigures, LiveSnapshot
from stalwart.metrics.serve import PathServer

__all__ = ["CONTENT_TYPE", "METRICS", "MetricsExporter", "metrics_registry", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What :func:`generate_latest` writes: the text format 0.0.4 (newer prometheus_client
releases name 1.0.0 in ``CONTENT_TYPE_LATEST``, which is negotiated; this is not)."""

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


class _SnapshotCollector(Collector):
    """The metric families of one snapshot (a custom collector: prometheus_client writes
    the exposition; the figures are computed by :class:`LiveFigures`, not by its
    instruments). ``source`` is read at each collection; None: no figures yet."""

    def __init__(
        self, source: Callable[[], LiveSnapshot | None], labels: dict[str, str] | None
    ) -> None:
        self._source = source
        self._names = sorted(labels or {})
        self._values = [(labels or {})[k] for k in self._names]

    def collect(self) -> Iterator[Metric]:
        s = self._source()
        if s is None:
            return
        for name, kind, help_, attr in METRICS:
            extra, samples = _samples(s, attr)
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = family(name, help_, labels=[*self._names, *extra])
            for values, v in samples:
                metric.add_metric([*self._values, *values], v)
            yield metric


def _samples(s: LiveSnapshot, attr: str) -> tuple[list[str], list[tuple[list[str], float]]]:
    """A metric's own label names and its (label values, value) samples in ``s``
    (None-valued figures have none)."""
    if attr == "persists":
        return ["result"], [(["ok"], s.persists_ok), (["failed"], s.persists_failed)]
    if attr == "recovering":
        return [], [([], 1 if s.status == "recovering" else 0)]
    if attr == "probes":
        return ["node", "probe", "device"], [([n, p, d], v) for n, p, d, v in s.probes]
    if attr == "preflight":
        return ["node"], [([m], v) for m, v in s.preflight]
    v = getattr(s, attr)
    return [], [] if v is None else [([], v)]


def metrics_registry(
    source: Callable[[], LiveSnapshot | None], labels: dict[str, str] | None = None
) -> CollectorRegistry:
    """A registry of its own (never prometheus_client's global one: several exporters in
    one process, one per agent in a test, do not collide) that collects ``source``'s
    snapshot at each scrape; ``labels`` are added to every sample."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(source, labels))
    return registry


def render_metrics(s: LiveSnapshot, labels: dict[str, str] | None = None) -> str:
    """The exposition text for one snapshot; ``labels`` are added to every sample."""
    return generate_latest(metrics_registry(lambda: s, labels)).decode()


class MetricsExporter:
    """Serves ``GET /metrics`` from a background thread; :meth:`update` swaps in new
    figures (the agent calls it as events arrive). Use as a context manager or call
    :meth:`start` and :meth:`close`."""

    def __init__(
        self, port: int = 0, host: str = "127.0.0.1", labels: dict[str, str] | None = None
    ) -> None:
        self.host, self.port, self.labels = host, port, dict(labels or {})
        self._snapshot: LiveSnapshot | None = None  # None: no figures yet
        self._lock = threading.Lock()
        self.live = LiveFigures()  # fed by emit(); rendered at the next scrape
        self._fed = False
        self.registry = metrics_registry(self._current, self.labels)
        self._server: PathServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def update(self, snapshot: LiveSnapshot) -> None:
        """Serve these figures from now on (for a caller that keeps its own totals)."""
        with self._lock:
            self._snapshot, self._fed = snapshot, False

    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None:
        """Take one event (same arguments as :meth:`EventLog.emit`), so the exporter can
        sit in an :class:`EventTee` or a :class:`LiveFeed` directly."""
        with self._lock:
            self.live.emit(kind, t=t, rank=rank, **fields)
            self._fed = True

    def _current(self) -> LiveSnapshot | None:
        with self._lock:
            if self._fed:
                self._snapshot, self._fed = self.live.snapshot(), False
            return self._snapshot

    def start(self) -> MetricsExporter:
        self._server = PathServer(
            self._answer, self.host, self.port, what="metrics", flag="--metrics-port"
        ).start()
        self.port = self._server.port
        return self

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        if path.split("?", 1)[0] != "/metrics":
            return 404, "text/plain; charset=utf-8", b"only /metrics is served here\n"
        return 200, CONTENT_TYPE, generate_latest(self.registry)

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
