"""metrics/prometheus.py: the exposition is prometheus_client's, from a registry of the
exporter's own; what it serves parses with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from stalwart.metrics.live import LiveFigures
from stalwart.metrics.prometheus import CONTENT_TYPE, METRICS, MetricsExporter, render_metrics


def _fed() -> LiveFigures:
    live = LiveFigures()
    live.emit("run_start", t=0.0, world_size=2, nnodes=1, strategy="restart")
    live.emit("steps", t=5.0, first_step=1, last_step=4, count=4, busy_s=4.0, t_first_start=1.0)
    dom = {"rank": None, "node": 0, "device": 'gpu"0\\\n'}  # every character to escape
    live.emit("probe", t=5.0, probe="disk", ok=False, skipped=False, detail="", domain=dom)
    live.emit("persist_end", t=5.0, step=4, ok=True, seconds=1.0, bytes_written=4096)
    return live


def _families(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
    }


def test_every_metric_parses_with_its_type_help_and_labels() -> None:
    text = render_metrics(_fed().snapshot(), labels={"job": 'j"1'})
    fams = _families(text)
    for name, kind, _help, _attr in METRICS:
        family = name.removesuffix("_total") if kind == "counter" else name
        assert fams[family][0] == kind, name
    _, steps = fams["stalwart_steps"]
    assert steps == [("stalwart_steps_total", {"job": 'j"1'}, 4.0)]
    _, probes = fams["stalwart_probe_ok"]
    want = {"job": 'j"1', "node": "0", "probe": "disk", "device": 'gpu"0\\\n'}
    assert probes == [("stalwart_probe_ok", want, 0.0)]  # escaped, and read back whole
    _, persists = fams["stalwart_checkpoint_persists"]
    assert {s[1]["result"]: s[2] for s in persists} == {"ok": 1.0, "failed": 0.0}


def test_the_served_scrape_parses_and_uses_no_global_registry() -> None:
    before = set(REGISTRY._names_to_collectors)  # the process-wide registry stays alone
    with MetricsExporter(labels={"job": "a"}) as a, MetricsExporter(labels={"job": "b"}) as b:
        with urllib.request.urlopen(a.url, timeout=30) as reply:
            assert reply.headers["Content-Type"] == CONTENT_TYPE
            assert reply.read() == b""  # no figures yet: no families
        for exporter, steps in ((a, 6), (b, 9)):
            live = _fed()
            live.emit("steps", t=6.0, first_step=5, last_step=steps, count=steps - 4, busy_s=1.0,
                      t_first_start=5.0)  # fmt: skip
            exporter.update(live.snapshot())
        for exporter, job, steps in ((a, "a", 6), (b, "b", 9)):
            with urllib.request.urlopen(exporter.url, timeout=30) as reply:
                fams = _families(reply.read().decode())
            assert fams["stalwart_step"][1] == [("stalwart_step", {"job": job}, float(steps))]
    assert set(REGISTRY._names_to_collectors) == before
