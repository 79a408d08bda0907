"""The straggler section of `stalwart report` (summary, JSON, HTML) and its Prometheus
counter, from a synthetic log holding a ``straggler`` event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalwart.cli.main import main
from stalwart.metrics.live import LiveFigures
from stalwart.metrics.prometheus import render_metrics


def _run(synth: Any) -> Path:
    synth.start(0.0, ws=2).steps(1.0, 20.0, 1, 60, 19.0).steps(20.0, 30.0, 61, 100, 10.0)
    synth.emit("fault_injected", 10.0, fault="slow", domain={"rank": 1, "node": 0}, spec="slow")
    synth.detect(22.0, 12.0, fault="straggler", rank=1, node=0)
    synth.emit("straggler", 22.0, domain={"rank": 1, "node": 0}, compute_s=0.3, median_s=0.1,
               ratio=3.0, score=20.0, windows=3, action="report", latency_s=12.0)  # fmt: skip
    synth.end(31.0)
    synth.close()
    return Path(synth.dir)


def test_the_report_lists_the_straggler_and_counts_no_failure(synth: Any, capsys: Any) -> None:
    run = _run(synth)
    assert main(["report", str(run), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (row,) = d["stragglers"]
    assert (row["rank"], row["node"], row["ratio"], row["action"]) == (1, 0, 3.0, "report")
    assert d["failures"] == 0  # the job never stopped for it
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "straggler: rank 1 (node 0) at 22.0s computes 300.0 ms/step, 3.00x" in out


def test_the_html_report_has_a_straggler_section(synth: Any, tmp_path: Path) -> None:
    page_path = tmp_path / "r.html"
    assert main(["report", str(_run(synth)), "--html", str(page_path)]) == 0
    page = page_path.read_text()
    assert "<h2>Stragglers</h2>" in page and 'id="stragglers"' in page
    assert "<td>300.0 ms</td>" in page and "<td>3.00</td>" in page


def test_a_run_without_stragglers_says_so(synth: Any, tmp_path: Path) -> None:
    synth.start(0.0, ws=2).steps(1.0, 30.0, 1, 100, 29.0).end(31.0)
    synth.close()
    page_path = tmp_path / "r.html"
    assert main(["report", str(synth.dir), "--html", str(page_path)]) == 0
    assert "No straggler" in page_path.read_text()


def test_prometheus_counts_stragglers() -> None:
    live = LiveFigures()
    assert "stalwart_stragglers_total 0" in render_metrics(live.snapshot())
    live.emit("straggler", t=5.0, domain={"rank": 1, "node": 0}, compute_s=0.3, median_s=0.1,
              score=20.0, windows=3, action="report")  # fmt: skip
    assert "stalwart_stragglers_total 1" in render_metrics(live.snapshot())
