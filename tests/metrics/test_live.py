"""Live figures, the console display and the Prometheus endpoint (scraped while live)."""

from __future__ import annotations

import io
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stalwart.errors import ConfigError
from stalwart.metrics import EventLog, read_events
from stalwart.metrics.console import ConsoleProgress
from stalwart.metrics.follow import EventFollower, LiveFeed, start_live
from stalwart.metrics.live import EventTee, LiveFigures
from stalwart.metrics.prometheus import CONTENT_TYPE, METRICS, MetricsExporter
from stalwart.metrics.report import load_run


def _feed_single_fault(sink: Any) -> None:
    """The events of conftest's single_fault scenario, in time order."""
    e = sink.emit
    e("run_start", t=0.0, job="j", world_size=4)
    e("steps", t=12.0, first_step=1, last_step=10, count=10, busy_s=10.0, t_first_start=2.0)
    e("snapshot", t=12.5, step=10, stall_s=0.5)
    e("snapshot", t=12.5, step=10, stall_s=0.5, rank=1)  # a second rank's report
    e("steps", t=20.5, first_step=11, last_step=18, count=8, busy_s=8.0, t_first_start=12.5)
    e("fault_injected", t=21.0, fault="kill", domain={"rank": 2})
    e("fault_detected", t=22.0, fault="crash", domain={"rank": 2}, latency_s=1.0)
    e("recovery_begin", t=22.0, strategy="flash", generation=2)
    e("restore", t=24.0, step=10, tier="memory", seconds=1.0)
    e("recovery_end", t=24.5, strategy="flash", generation=2, restored_step=10, steps_lost=8)
    e("steps", t=33.0, first_step=11, last_step=18, count=8, busy_s=8.0, t_first_start=25.0)
    e("steps", t=35.0, first_step=19, last_step=20, count=2, busy_s=2.0, t_first_start=33.0)
    e("persist_end", t=35.0, step=10, ok=True, seconds=3.0, bytes_written=4096)
    e("run_end", t=36.0, status="ok")


def test_live_figures_follow_a_fault() -> None:
    live = LiveFigures()
    _feed_single_fault(live)
    s = live.snapshot()
    assert (s.step, s.steps_total, s.lost_steps, s.lost_s) == (20, 28, 8, 8.0)
    assert s.busy_s == 28 and s.ettr == 20 / 36 and s.elapsed_s == 36
    assert s.incidents == 1 and s.last_rto_s == 4 and s.last_detection_s == 1
    assert s.checkpoints == 1 and s.stall_s == 0.5 and s.restores == 1 and s.restore_s == 1
    assert s.persists_ok == 1 and s.persisted_bytes == 4096 and s.status == "ended"


def test_tee_writes_the_log_and_feeds_live_sinks_the_same_times(tmp_path: Path) -> None:
    live = LiveFigures()
    with EventLog(str(tmp_path / "events.jsonl")) as log:
        tee = EventTee(log, live)
        _feed_single_fault(tee)
        tee.emit("note", message="untimed: both sinks get one timestamp")
    events = read_events(str(tmp_path / "events.jsonl")).events
    assert len(events) == 15 and live.t_last == events[-1].t


def test_console_plain_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    con = ConsoleProgress(out, tty=False, total_steps=20, plain_every_s=10.0)
    _feed_single_fault(con)
    con.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines[0].startswith("step 10/20  ")  # first progress line
    assert "fault injected: kill rank 2" in lines
    assert "training resumed at step 11: RTO 4.00s" in lines
    assert lines[-1].startswith("run ended: ok  step 20/20") and "ETTR 55.6%" in lines[-1]
    assert "incidents 1  last RTO 4.0s" in lines[-1]
    assert len(lines) <= 10  # progress display, not one line per event


def test_console_single_updating_line_on_a_tty() -> None:
    out = io.StringIO()
    con = ConsoleProgress(out, tty=True, refresh_s=0.25)
    _feed_single_fault(con)
    con.close()
    text = out.getvalue()
    assert text.count("\r") >= 3 and text.endswith("\n")
    # Everything but the notable events is overwritten in place: few real lines.
    kept = [ln.split("\r")[-1].replace("\x1b[K", "") for ln in text.split("\n") if ln]
    assert any(ln.startswith("fault detected: crash") for ln in kept)
    assert len(kept) <= 7


_SAMPLE = re.compile(r"^(stalwart_[a-z_]+)(\{[^}]*\})? (\S+)$")


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"] == CONTENT_TYPE
        text = resp.read().decode()
    values: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter") and (kind == "counter") == name.endswith("_total")
            typed.add(name)
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            assert m.group(1) in typed  # TYPE before samples
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def _wait_for(cond: Callable[[], bool], what: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_prometheus_endpoint_serves_live_figures() -> None:
    live = LiveFigures()
    stop = threading.Event()
    step = [0]

    def trainer() -> None:  # a run in progress: a batch of 5 steps per iteration
        t = 0.0
        live.emit("run_start", t=t, job="j", world_size=2)
        while not stop.is_set() and step[0] < 10_000:
            live.emit(
                "steps",
                t=t + 1,
                first_step=step[0] + 1,
                last_step=step[0] + 5,
                count=5,
                busy_s=1.0,
                t_first_start=t,
            )
            step[0] += 5
            t += 1
            exporter.update(live.snapshot())
            stop.wait(0.005)

    with MetricsExporter(labels={"job": "j"}) as exporter:
        assert exporter.url.startswith("http://127.0.0.1:")
        feeder = threading.Thread(target=trainer)
        feeder.start()
        try:
            seen: list[float] = []

            def advanced() -> bool:
                v = _scrape(exporter.url).get('stalwart_step{job="j"}')
                if v is not None:
                    seen.append(v)
                return len(set(seen)) >= 3  # three scrapes saw three different steps

            _wait_for(advanced, "the scraped step to advance while the run feeds it")
        finally:
            stop.set()
            feeder.join(timeout=30)
        assert not feeder.is_alive()
        final = _scrape(exporter.url)
        assert final['stalwart_step{job="j"}'] == step[0]
        assert final['stalwart_steps_total{job="j"}'] == step[0]
        assert final['stalwart_ettr_ratio{job="j"}'] == 1.0
        assert final['stalwart_world_size{job="j"}'] == 2
        assert final['stalwart_checkpoint_persists_total{job="j",result="ok"}'] == 0
        assert "stalwart_last_rto_seconds" not in "".join(final)  # no incident: no sample
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(exporter.url.replace("/metrics", "/other"), timeout=10)
    assert not exporter.serving  # stopped and joined


def test_every_metric_documented() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "goodput.md").read_text()
    for name, *_ in METRICS:
        assert f"`{name}`" in doc, name


def test_busy_port_is_a_clear_error() -> None:
    with (
        MetricsExporter() as first,
        pytest.raises(ConfigError, match="pass a free --metrics-port"),
    ):
        MetricsExporter(port=first.port).start()


@pytest.mark.process  # a fresh interpreter (tests/_tiers.py)
def test_importing_metrics_loads_no_plotting_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys, stalwart.metrics.report, stalwart.metrics.html, stalwart.metrics.console,"
        " stalwart.metrics.prometheus, stalwart.cli.report; "
        "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_live_feed_tails_the_log_into_exporter_and_console(tmp_path: Path) -> None:
    """The agent's route: workers append to events.jsonl, a LiveFeed tails it into the
    exporter and the console, and Prometheus scrapes while the run goes on."""
    path = str(tmp_path / "events.jsonl")
    stop = threading.Event()
    written = [0]

    def worker() -> None:  # rank 0 of a run in progress, writing the shared log
        with EventLog(path) as log:
            log.emit("run_start", t=0.0, job="j", world_size=2)
            t = 0.0
            while not stop.is_set() and written[0] < 20_000:
                log.emit(
                    "steps",
                    t=t + 1,
                    first_step=written[0] + 1,
                    last_step=written[0] + 2,
                    count=2,
                    busy_s=1.0,
                    t_first_start=t,
                )
                written[0] += 2
                t += 1
                stop.wait(0.005)

    out = io.StringIO()
    console = ConsoleProgress(out, tty=False, plain_every_s=1e9)
    with MetricsExporter() as exporter:
        feed = LiveFeed(path, exporter, console, interval_s=0.01).start()
        writer = threading.Thread(target=worker)
        writer.start()
        try:
            seen: set[float] = set()

            def advanced() -> bool:
                v = _scrape(exporter.url).get("stalwart_step")
                if v is not None:
                    seen.add(v)
                return len(seen) >= 3

            _wait_for(advanced, "the scraped step to advance as the log grows")
        finally:
            stop.set()
            writer.join(timeout=30)
            feed.close()
        assert not writer.is_alive() and feed._thread is None
        final = _scrape(exporter.url)
        assert final["stalwart_step"] == written[0] == final["stalwart_steps_total"]
        assert final["stalwart_ettr_ratio"] == 1.0
    assert console.live.step == written[0] and out.getvalue().startswith("step 2  ")


def test_follower_waits_for_a_line_being_written(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    f = EventFollower(str(path))
    assert f.poll() == []  # no file yet
    with EventLog(str(path)) as log:
        log.emit("note", t=1.0, message="a")
    with open(path, "ab") as fh:
        fh.write(b'{"v":1,"t":2.0,"kind":"note","host":"h","pid":1,"node":null,"rank":null,')
    assert [e["message"] for e in f.poll()] == ["a"]
    with open(path, "ab") as fh:
        fh.write(b'"message":"b"}\n')
    assert [e["message"] for e in f.poll()] == ["b"] and f.problems == []


def test_start_live_serves_and_prints_then_stops(tmp_path: Path, capsys: Any) -> None:
    with EventLog(str(tmp_path / "events.jsonl")) as log:
        _feed_single_fault(log)
    feed = start_live(str(tmp_path), metrics_port=0, interval_s=0.01)
    exporter = next(s for s in feed.sinks if isinstance(s, MetricsExporter))
    try:
        _wait_for(lambda: _scrape(exporter.url).get("stalwart_step") == 20, "the live step")
        assert _scrape(exporter.url)["stalwart_last_rto_seconds"] == 4
    finally:
        feed.close()
    assert not exporter.serving and feed._thread is None
    assert "run ended: ok" in capsys.readouterr().err


class _Broken:
    def emit(
        self, kind: str, *, t: float | None = None, rank: int | None = None, **fields: Any
    ) -> None:
        raise OSError("stream closed")


def test_a_failing_sink_does_not_starve_the_others(tmp_path: Path) -> None:
    with EventLog(str(tmp_path / "events.jsonl")) as log:
        _feed_single_fault(log)
    live = LiveFigures()
    feed = LiveFeed(str(tmp_path / "events.jsonl"), _Broken(), live)
    assert feed.pump() == 14
    assert live.step == 20 and len(feed.errors) == 10 and "stream closed" in feed.errors[0]


@pytest.mark.parametrize(
    "name", ["never_failed", "single_fault", "overlapping", "full_restart", "elastic"]
)
def test_live_figures_end_where_the_report_does(make_run: Any, name: str) -> None:
    run = make_run(name)
    live = LiveFigures()
    for e in read_events(str(run / "events.jsonl")).events:
        live.emit(e.kind, t=e.t, rank=e.rank, **e.fields)
    s, d = live.snapshot(), load_run(str(run)).to_dict()
    assert s.ettr == pytest.approx(d["ettr"], rel=1e-12)
    assert s.lost_steps == d["steps"]["lost"] and s.step == d["steps"]["last"]
    assert s.last_rto_s == d["rto_s"]["max"]  # the outage of the last (here: only) one
