"""The report of a plain script: its route in the header, its steps counted."""

from __future__ import annotations

from typing import Any

from stalwart.cli.main import main
from stalwart.metrics.html import render_html
from stalwart.metrics.report import load_run


def test_plain_script_report_names_its_route(synth: Any, capsys: Any) -> None:
    synth.start(0.0).emit("route", 1.0, route="plain", recovery="restart")
    synth.steps(2.0, 10.0, 1, 80, 8.0).end(11.0)
    run = synth.close()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "strategy=flash (plain script: torchrun's restart route" in out
    assert "productive steps 80" in out
    d = load_run(str(run)).to_dict()
    assert d["route"] == "plain" and d["ettr"] is not None and d["ettr"] > 0.7
    assert "plain script" in render_html(d)


def test_a_stalwart_run_keeps_its_strategy(synth: Any, capsys: Any) -> None:
    synth.start(0.0).emit("route", 1.0, route="stalwart", recovery="flash")
    run = synth.steps(2.0, 10.0, 1, 80, 8.0).end(11.0).close()
    assert main(["report", str(run)]) == 0
    assert "strategy=flash  status=ok" in capsys.readouterr().out
