"""The integrity section of `stalwart report` (summary, JSON, HTML) and its Prometheus
metrics, from a synthetic log holding replica checks, a digest mismatch rolled back and a
NaN replayed then skipped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalwart.cli.main import main
from stalwart.metrics.live import LiveFigures
from stalwart.metrics.prometheus import render_metrics

_SDC = {"step": 40, "detected_step": 41, "ranks": [1], "action": "rollback",
        "digests": ["00000000000000aa", "00000000000000bb", "00000000000000aa"],
        "verified_step": 20}  # fmt: skip


def _run(synth: Any) -> Path:
    synth.start(0.0, ws=3).steps(1.0, 20.0, 1, 60, 19.0).steps(20.0, 30.0, 61, 100, 10.0)
    for i, step in enumerate((20, 60, 80)):
        synth.emit("sdc_check", 5.0 + i, step=step, digest=f"{step:016x}", replicas=3)
    synth.emit("sdc_detected", 12.0, **_SDC)
    for rank in (0, 2):  # `report`: each rank that saw it writes one
        synth.emit("numeric_fault", 25.0, step=90, reason="spike", ranks=[rank],
                   action="report", restored_step=-1, skipped_step=-1, value=9.5, z=7.25,
                   rank=rank)  # fmt: skip
    synth.emit("numeric_fault", 27.0, step=95, reason="nonfinite", ranks=[1],
               action="rollback", restored_step=80, skipped_step=95)  # fmt: skip
    synth.end(31.0)
    synth.close()
    return Path(synth.dir)


def test_the_report_counts_the_checks_and_lists_each_fault(synth: Any, capsys: Any) -> None:
    run = _run(synth)
    assert main(["report", str(run), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["integrity"]
    assert (d["checks"], d["last_check_step"], d["replicas"]) == (3, 80, 3)
    (sdc,) = d["sdc"]
    assert (sdc["step"], sdc["ranks"], sdc["verified_step"]) == (40, [1], 20)
    spike, nan = d["numeric"]
    assert spike["ranks"] == [0, 2] and spike["z"] == 7.25  # one row for both ranks
    assert (nan["action"], nan["restored_step"], nan["skipped_step"]) == ("rollback", 80, 95)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "integrity: 3 replica digest checks passed (the last at step 80, 3 replicas)" in out
    assert "sdc: replica digests of step 40 differed (ranks [1]) at step 41" in out
    assert "rollback to step 20" in out
    assert "numeric: nonfinite loss at step 95 (ranks [1])" in out
    assert "rollback to step 80, step 95 skipped" in out


def test_the_html_report_has_an_integrity_section(synth: Any, tmp_path: Path) -> None:
    page_path = tmp_path / "r.html"
    assert main(["report", str(_run(synth)), "--html", str(page_path)]) == 0
    page = page_path.read_text()
    assert "<h2>Silent data corruption and numerical faults</h2>" in page
    assert 'id="sdc"' in page and 'id="numeric"' in page
    assert "<td>9.5</td>" in page and "<td>7.2</td>" in page


def test_a_run_without_checks_says_they_did_not_run(synth: Any, tmp_path: Path) -> None:
    synth.start(0.0, ws=2).steps(1.0, 30.0, 1, 100, 29.0).end(31.0)
    synth.close()
    page_path = tmp_path / "r.html"
    assert main(["report", str(synth.dir), "--html", str(page_path)]) == 0
    page = page_path.read_text()
    assert "No replica digest check ran (--sdc-every 0" in page
    assert "No NaN, inf or loss spike" in page


def test_prometheus_counts_checks_detections_and_numeric_faults() -> None:
    live = LiveFigures()
    text = render_metrics(live.snapshot())
    assert "stalwart_sdc_checks_total 0" in text and "stalwart_numeric_faults_total 0" in text
    assert "\nstalwart_sdc_last_check_step " not in text  # no check yet: no sample
    live.emit("sdc_check", t=1.0, step=100, digest="00", replicas=2)
    live.emit("sdc_detected", t=2.0, **_SDC)
    for rank in (0, 1):
        live.emit("numeric_fault", t=3.0, rank=rank, step=7, reason="nonfinite", ranks=[rank],
                  action="report")  # fmt: skip
    text = render_metrics(live.snapshot())
    assert "stalwart_sdc_checks_total 1" in text and "stalwart_sdc_last_check_step 100" in text
    assert "stalwart_sdc_detections_total 1" in text
    assert "stalwart_numeric_faults_total 1" in text  # two ranks, one fault
