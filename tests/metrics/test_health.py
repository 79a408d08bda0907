"""The node health section of `stalwart report` (summary, JSON, HTML) and its Prometheus
metrics, from a synthetic log holding ``probe`` and ``preflight`` events as the agents
write them (agent/health/_node.py, agent/health/preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalwart.cli.main import main
from stalwart.metrics.live import LiveFigures
from stalwart.metrics.prometheus import render_metrics


def _probe(s: Any, t: float, probe: str, ok: bool, node: int, **f: Any) -> None:
    dom = {"rank": f.pop("rank", None), "node": node, "device": f.pop("device", None)}
    s.emit("probe", t, probe=probe, ok=ok, skipped=f.pop("skipped", False),
           detail=f.pop("detail", f"{probe} fine"), unit=f.pop("unit", "B"), domain=dom,
           **f)  # fmt: skip


def _run(synth: Any) -> Path:
    s = synth.start(0.0, ws=4, strategy="restart")
    s.emit("preflight", 1.0, member="node0", ok=True, verdict="ok", matmul_s=0.002,
           allreduce_s=0.004, partner=1, seconds=2.5)  # fmt: skip
    s.emit("preflight", 1.0, member="node1", ok=False, verdict="slow node", matmul_s=0.02,
           allreduce_s=0.03, partner=0, retest_partner=2, retest_allreduce_s=0.031,
           seconds=2.5)  # fmt: skip
    s.emit("note", 1.5, message="node 1: preflight slow node: 10x; --on-probe report: the "
           "node stays in the job")  # fmt: skip
    _probe(s, 2.0, "host", True, 0, value=8e9, limit=1e9)
    _probe(s, 2.0, "nvml", True, 0, skipped=True, detail="pynvml is not installed")
    _probe(s, 2.0, "disk", True, 1, value=5e10, limit=1e9)
    s.steps(3.0, 20.0, 1, 50, 17.0)
    _probe(
        s, 21.0, "disk", False, 1, value=1e8, limit=1e9, unit="bytes", detail="1e8 B free < 1e9 B"
    )
    s.detect(21.0, 0.0, fault="probe_disk", node=1)
    s.emit("isolation", 21.5, member="node1", reason="probe disk failed: 1e8 B free",
           blocklisted=True)  # fmt: skip
    _probe(s, 22.0, "shm", False, 0, rank=2, detail="snapshot of 2 GB does not fit")
    _probe(s, 25.0, "shm", True, 0, rank=2, detail="fits again")
    s.steps(26.0, 40.0, 51, 90, 14.0).end(41.0)
    s.close()
    return Path(s.dir)


def test_the_json_and_summary_show_readings_failures_and_verdicts(synth: Any, capsys: Any) -> None:
    assert main(["report", str(_run(synth)), "--json"]) == 0
    h = json.loads(capsys.readouterr().out)["health"]
    last = {(r["node"], r["probe"], r["rank"]): r for r in h["probes"]}
    assert not last[(1, "disk", None)]["ok"] and last[(1, "disk", None)]["value"] == 1e8
    assert last[(0, "nvml", None)]["skipped"] and last[(0, "shm", 2)]["ok"]
    disk, shm = h["probe_failures"]
    assert (disk["t"], disk["healthy_again_t"]) == (21.0, None)
    assert disk["action"] == "isolated (blocklisted)"
    assert (shm["action"], shm["healthy_again_t"]) == ("snapshot refused until it fits", 25.0)
    n0, n1 = h["preflight"]
    assert (n0["verdict"], n0["action"], n0["matmul_s"]) == ("ok", "-", 0.002)
    assert n1["action"] == "stayed: --on-probe report: the node stays in the job"
    assert (n1["retest_partner"], n1["retest_allreduce_s"]) == (2, 0.031)
    assert main(["report", str(synth.dir)]) == 0
    out = capsys.readouterr().out
    assert "node health: 4 probe readings on 2 node(s), 1 failing now, 2 failure(s)" in out
    assert "probe disk failed on node 1 at 21.0s: 1e8 B free < 1e9 B; isolated" in out
    assert "preflight node1: slow node (matmul 20.0 ms, allreduce 30.0 ms with node 0, " in out


def test_the_html_report_has_a_node_health_section(synth: Any, tmp_path: Path) -> None:
    page_path = tmp_path / "r.html"
    assert main(["report", str(_run(synth)), "--html", str(page_path)]) == 0
    page = page_path.read_text()
    assert "<h2>Node health</h2>" in page
    for ident in ('id="probes"', 'id="probe-failures"', 'id="preflight"'):
        assert ident in page
    assert "<td>FAILING</td>" in page and "<td>skipped</td>" in page
    assert "<td>isolated (blocklisted)</td>" in page and "<td>31.0 ms</td>" in page
    assert "<td>95 MiB</td>" in page  # the failing disk's 1e8 bytes, as a reader reads them


def test_a_run_without_probes_says_so(synth: Any, tmp_path: Path, capsys: Any) -> None:
    synth.start(0.0, ws=2).steps(1.0, 30.0, 1, 100, 29.0).end(31.0)
    synth.close()
    page_path = tmp_path / "r.html"
    assert main(["report", str(synth.dir), "--html", str(page_path)]) == 0
    assert "No probe reading nor preflight check" in page_path.read_text()
    assert main(["report", str(synth.dir)]) == 0
    assert "node health" not in capsys.readouterr().out


def test_a_detail_cannot_inject_markup(synth: Any, tmp_path: Path) -> None:
    synth.start(0.0, ws=2)
    _probe(synth, 1.0, "disk", False, 0, detail="<script>x</script>")
    synth.end(2.0).close()
    page_path = tmp_path / "r.html"
    assert main(["report", str(synth.dir), "--html", str(page_path)]) == 0
    assert "<script>x" not in page_path.read_text()


def test_prometheus_shows_probe_state_failures_and_preflight() -> None:
    live = LiveFigures()
    text = render_metrics(live.snapshot())
    assert "stalwart_probe_failures_total 0" in text and "stalwart_probe_ok{" not in text
    dom = {"rank": None, "node": 1, "device": None}
    live.emit("probe", t=1.0, probe="disk", ok=True, skipped=False, detail="", domain=dom)
    live.emit("probe", t=1.0, probe="nvml", ok=True, skipped=True, detail="", domain=dom)
    text = render_metrics(live.snapshot())
    # prometheus_client writes the labels sorted by name
    assert 'stalwart_probe_ok{device="",node="1",probe="disk"} 1.0' in text
    assert 'probe="nvml"' not in text  # skipped: no reading
    live.emit("probe", t=2.0, probe="disk", ok=False, skipped=False, detail="", domain=dom)
    live.emit("preflight", t=3.0, member="node1", ok=False, verdict="slow link", seconds=4.5)
    text = render_metrics(live.snapshot(), labels={"job": "j"})
    assert 'stalwart_probe_ok{device="",job="j",node="1",probe="disk"} 0.0' in text
    assert 'stalwart_probe_failures_total{job="j"} 1' in text
    assert 'stalwart_preflight_seconds{job="j"} 4.5' in text
    assert 'stalwart_preflight_ok{job="j",node="1"} 0' in text
