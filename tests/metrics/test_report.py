"""`stalwart report`: summary, JSON, HTML content, partial and empty logs, convergence."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli.main import main
from stalwart.metrics.report import ReportError, load_run


def _json(run: Path, capsys: Any, *extra: str) -> dict[str, Any]:
    assert main(["report", str(run), "--json", *extra]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_summary_names_the_figures(make_run: Any, capsys: Any) -> None:
    assert main(["report", str(make_run("overlapping"))]) == 0
    out = capsys.readouterr().out
    for needle in ("ETTR 58.1%", "failures 2", "RTO p50 5.00s p95 5.90s max 6.00s", "MTBF 15.5s"):
        assert needle in out
    assert "incident 1: kill of rank 3 at" in out and "(during recovery)" in out
    assert "PARTIAL" not in out
    incidents = [line for line in out.splitlines() if "incident" in line]
    assert incidents and not any("{" in line or "'" in line for line in incidents)  # no reprs


def test_json_figures(make_run: Any, capsys: Any) -> None:
    d = _json(make_run("overlapping"), capsys)
    assert not d["partial"] and d["status"] == "ok" and d["failures"] == 2
    assert math.fsum(d["buckets_s"].values()) == d["wall_s"] == 31
    assert d["rto_s"] == {"n": 2, "p50": 5.0, "p95": 5.9, "max": 6.0, "mean": 5.0}
    assert d["detection_latency_s"]["max"] == 1.0
    assert d["steps"] == {
        "productive": 18,
        "lost": 4,
        "lost_reported": 4,
        "last": 18,
        "productive_per_s": 18 / 31,
    }
    m = d["mtbf"]  # 2 failures in 31 s: 2T/chi2(0.95; 6) and 2T/chi2(0.05; 4)
    assert m["mtbf_s"] == 15.5
    assert m["lower_s"] == pytest.approx(62 / 12.591587, rel=1e-6)
    assert m["upper_s"] == pytest.approx(62 / 0.710723, rel=1e-6)
    assert [i["t_fault"] for i in d["incidents"]] == [16, 18]


def test_checkpoint_overhead(make_run: Any, capsys: Any) -> None:
    c = _json(make_run("never_failed"), capsys)["checkpoint"]
    assert c["snapshots"] == 1 and c["stall_s"] == 0.5 and c["stall_pct"] == 100 * 0.5 / 32
    assert c["persist_s"] == 4.5 and c["persist_pct"] == 100 * 4.5 / 32
    assert c["persists_ok"] == 1 and c["persists_failed"] == 0 and c["bytes_written"] == 1 << 20


def test_never_failed_mtbf_has_only_a_lower_bound(make_run: Any, capsys: Any) -> None:
    d = _json(make_run("never_failed"), capsys)
    assert d["failures"] == 0 and d["incidents"] == [] and d["rto_s"]["p50"] is None
    assert d["mtbf"]["mtbf_s"] is None and d["mtbf"]["upper_s"] is None
    assert d["mtbf"]["lower_s"] == pytest.approx(64 / 5.991465, rel=1e-6)


def test_html_is_self_contained_and_lists_every_incident(make_run: Any, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(make_run("overlapping")), "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count('src="data:image/svg+xml;base64,') == 3  # timeline, badput, RTO
    for bad in ('src="http', 'href="http', "<script", "<link", "@import", "url("):
        assert bad not in page
    assert "<td>#0</td>" in page and "<td>#1</td>" in page and "during recovery" in page
    assert 'id="partial"' not in page


def test_truncated_log_gives_a_partial_report(make_run: Any, capsys: Any, tmp_path: Path) -> None:
    run = make_run("single_fault")
    with open(run / "events.jsonl", "ab") as f:
        f.write(b'{"v":1,"t":40.0,"kind":"ste')
    d = _json(run, capsys)
    assert d["partial"] and any("events.jsonl" in p for p in d["problems"])
    assert d["wall_s"] == 36 and d["failures"] == 1  # what the log does show still counts
    assert main(["report", str(run), "--html", str(tmp_path / "p.html")]) == 0
    assert "PARTIAL REPORT" in capsys.readouterr().out
    assert 'id="partial"' in (tmp_path / "p.html").read_text()


def test_run_cut_off_mid_recovery_is_partial(synth: Any, capsys: Any) -> None:
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0).fault(10.0, rank=1)
    synth.detect(10.5, 0.5, rank=1).rec_begin(10.5, 2).restore(12.0, 10, 1.0)
    d = _json(synth.close(), capsys)
    assert d["partial"] and any("no run_end" in p for p in d["problems"])
    assert d["wall_s"] == 12 and d["status"] is None
    assert d["buckets_s"]["restore"] == 1 and d["buckets_s"]["recovery"] == 0.5
    assert d["incidents"][0]["rto_s"] is None and d["failures"] == 1


def test_empty_log_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "events.jsonl").write_bytes(b"")
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no events" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_bad_band_is_a_clear_error(make_run: Any, capsys: Any) -> None:
    assert main(["report", str(make_run("never_failed")), "--band", "2"]) == 2
    assert "--band must be a fraction" in capsys.readouterr().err


def _ref_loss(step: int) -> float:
    return 10.0 / step


def _run_loss(s: Any) -> None:  # the elastic run's losses, at times inside its batches
    for step in range(1, 11):
        s.emit("loss", 1.0 + step, step=step, value=_ref_loss(step))
    for step in range(11, 21):  # off by 20% for three steps after the shrink
        v = _ref_loss(step) * (1.2 if step <= 13 else 1.0)
        s.emit("loss", 17.0 + 1.2 * (step - 10), step=step, value=v)
    for step in range(21, 31):
        s.emit("loss", 31.0 + step - 20, step=step, value=_ref_loss(step))


def test_elastic_convergence_against_reference(make_run: Any, synth: Any, capsys: Any) -> None:
    synth.start(0.0).steps(0.0, 30.0, 1, 30, 30.0)
    for step in range(1, 31):
        synth.emit("loss", float(step), step=step, value=_ref_loss(step))
    ref = synth.end(30.0).close()
    run = make_run("elastic", "elastic", _run_loss)
    d = _json(run, capsys, "--reference", str(ref))
    conv = [
        (c["resume_step"], c["cause"], c["compared"], c["steps_to_converge"])
        for c in d["convergence"]
    ]
    assert conv == [(11, "incident", 10, 3), (21, "reconfiguration", 10, 0)]
    assert d["convergence"][0]["max_rel_deviation"] == pytest.approx(0.2)
    assert len(d["series"]["reference_loss"]) == 30 and len(d["series"]["loss"]) == 30


def test_reference_without_loss_is_a_clear_error(make_run: Any) -> None:
    run, ref = make_run("elastic", "a"), make_run("never_failed", "b")
    with pytest.raises(ReportError, match="logged no loss"):
        load_run(str(run), reference=str(ref))


def test_inconsistent_batches_warn_without_marking_partial(synth: Any, capsys: Any) -> None:
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0).steps(9.0, 20.0, 11, 20, 10.0).end(20.0)
    d = _json(synth.close(), capsys)
    assert not d["partial"] and any("overlap the batch before" in p for p in d["problems"])
    assert math.fsum(d["buckets_s"].values()) == d["wall_s"] == 20
    assert main(["report", str(synth.dir)]) == 0
    assert "warnings: steps 11..20 overlap" in capsys.readouterr().out


def test_persist_cost_is_the_slowdown_of_steps_while_persisting(synth: Any, capsys: Any) -> None:
    # 1.0 s/step normally; 1.2 s/step in the batch that ran during the persist [10, 22].
    synth.start(0.0).steps(0.0, 10.0, 1, 10, 10.0).persist(10.0, 22.0, 10)
    synth.steps(10.0, 22.0, 11, 20, 12.0).steps(22.0, 32.0, 21, 30, 10.0).end(32.0)
    c = _json(synth.close(), capsys)["checkpoint"]
    assert c["persist_slowdown"] == pytest.approx(0.2) and c["persist_overhead_s"] == 2
    assert c["persist_overhead_pct"] == 100 * 2 / 32 and c["persist_pct"] == 100 * 12 / 32


def test_persist_cost_unknown_without_a_baseline(make_run: Any, capsys: Any) -> None:
    c = _json(make_run("never_failed"), capsys)["checkpoint"]  # the persist covers < half
    assert c["persist_slowdown"] is None and c["persist_overhead_pct"] is None


def test_the_agents_start_up_is_named_in_the_startup_bucket(synth: Any, capsys: Any) -> None:
    s = synth.emit("run_start", 10.0, job="j", world_size=2, strategy="flash", launch_t=4.0)
    run = s.steps(12.0, 20.0, 1, 8, 8.0).end(20.0).close()
    d = _json(run, capsys)
    assert d["wall_s"] == 16.0 and d["launch_s"] == 6.0 and d["buckets_s"]["startup"] == 8.0
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "wall 16.0s" in out and "ETTR 50.0%" in out
    (line,) = [x for x in out.splitlines() if x.strip().startswith("startup")]
    assert "6.00s of it before the workers started" in line
