"""bench/regress.py and bench/report.py's page, in process on bench lines the harness
wrote from scripted repetitions."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _line(harness: ModuleType, values: list[float], invalid: bool = False) -> dict[str, Any]:
    def measure(rep: int) -> dict[str, Any]:
        bad = [harness.Invalid("rto_s", "rto_s: met 0 faults")] if invalid else []
        return {"rto_s": values[rep], "_invalid": bad}

    doc: dict[str, Any] = harness.repeat(
        measure, len(values), load=lambda: 3.0, log=lambda line: None, outside=None
    ).document()
    return doc


@pytest.fixture
def regress(harness: ModuleType) -> ModuleType:
    import regress as mod

    return mod


def _write(path: Path, doc: dict[str, Any]) -> str:
    path.write_text("a progress line\n" + json.dumps(doc) + "\n")
    return str(path)


def test_a_median_outside_the_old_spread_is_flagged(
    harness: ModuleType, regress: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old.json", _line(harness, [1.0, 1.2, 1.4]))
    same = _write(tmp_path / "same.json", _line(harness, [1.1, 1.3, 1.35]))
    worse = _write(tmp_path / "worse.json", _line(harness, [2.0, 2.1, 2.2]))
    assert regress.main([old, same]) == 0
    assert regress.main([old, worse]) == 1
    assert "rto_s median 1.2 [1..1.4] -> 2.1" in capsys.readouterr().out
    assert regress.main([old, worse, "--slack", "1.0"]) == 0


def test_report_results_files_written_indented_are_read(
    harness: ModuleType, regress: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/report.py writes bench/results/*.json indented, over many lines: the file
    the docs tell a user to compare must be readable as a whole, not by its last line."""

    def results(values: list[float]) -> str:
        path = tmp_path / f"r{values[0]}.json"
        doc = {"date": "d", "benches": {"node_loss": _line(harness, values)}}
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return str(path)

    old, worse = results([1.0, 1.2, 1.4]), results([2.0, 2.1, 2.2])
    assert regress.main([old, old]) == 0
    assert regress.main([old, worse]) == 1
    assert "node_loss" in capsys.readouterr().out


def test_an_invalid_figure_is_skipped_not_compared(
    harness: ModuleType, regress: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old.json", _line(harness, [1.0, 1.2]))
    new = _write(tmp_path / "new.json", _line(harness, [9.0, 9.0], invalid=True))
    assert regress.main([old, new]) == 0
    assert "1 skipped" in capsys.readouterr().out


def test_a_line_without_spread_is_refused(
    regress: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old.json", {"rto_s": 1.0})
    assert regress.main([old, old]) == 2
    assert "no 'spread'" in capsys.readouterr().out


def test_the_page_shows_median_spread_and_validity(harness: ModuleType, tmp_path: Path) -> None:
    import report

    results = {
        "date": "2026-12-02 20:00 UTC",
        "commit": "abc1234",
        "quick": True,
        "benches": {
            "node_loss": _line(harness, [0.4, 0.5, 0.45]),
            "routes": _line(harness, [1.0], invalid=True),
        },
    }
    page = report.render(results)
    assert "commit abc1234" in page and "quick" in page
    assert "| rto_s | 0.45 | 0.4 | 0.5 | 3 | yes |" in page
    assert "| rto_s | 1 | 1 | 1 | 1 | **no** |" in page
    assert "- invalid: rto_s: met 0 faults" in page
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    page_path = tmp_path / "benchmarks.md"
    argv = ["--render-only", "--results", str(path), "--page", str(page_path)]
    assert report.main(argv) == 0 and page_path.read_text() == page


def test_keep_reruns_one_bench_and_keeps_the_others_with_when_they_ran(
    harness: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import report

    path = tmp_path / "results.json"
    old_line = {**_line(harness, [0.4, 0.5, 0.45]), "ran": {"date": "then", "commit": "old"}}
    old = {"date": "then", "commit": "old", "quick": False, "benches": {"node_loss": old_line}}
    path.write_text(json.dumps(old))
    monkeypatch.setattr(
        report, "run_bench", lambda name, quick, routes: _line(harness, [2.0, 3.0, 4.0])
    )
    monkeypatch.setattr(report, "_commit", lambda: "new")
    page = tmp_path / "benchmarks.md"
    argv = ["--only", "checkpoint", "--keep", "--results", str(path), "--page", str(page)]
    assert report.main([*argv, "--routes-page", str(tmp_path / "none.md")]) == 0
    got = json.loads(path.read_text())["benches"]
    assert got["node_loss"] == old_line and got["checkpoint"]["spread"]["rto_s"]["median"] == 3.0
    assert "ran: then, commit old" in page.read_text()
    # without --keep the run is the only line; a quick run never mixes with a full one
    assert report.main([*argv[:2], "--results", str(path), "--page", str(page)]) == 0
    assert list(json.loads(path.read_text())["benches"]) == ["checkpoint"]
    assert report.main([*argv, "--quick"]) == 2


def test_the_routes_page_table_is_the_runs_output(harness: ModuleType) -> None:
    import report

    table = (
        "# stalwart compare: nanogpt.py\n\ntrace `kill every=20s`\n\n| route |\n|---|\n| flash |\n"
    )
    page = "intro\n<!-- bench:routes -->\n| old |\n<!-- /bench:routes -->\nafter\n"
    got = report.routes_table({"table_md": table}, page)
    assert got.startswith("intro\n<!-- bench:routes -->\ntrace `kill every=20s`")
    assert "| flash |\n<!-- /bench:routes -->\nafter\n" in got and "| old |" not in got
    assert "# stalwart compare" not in got
    assert report.routes_table({}, page) == page  # no table from the run: left as it was
    assert report.routes_table({"table_md": table}, "no markers") == "no markers"


@pytest.mark.process  # a stand-in bench script
def test_a_benchs_lines_are_shown_as_they_come_and_its_json_line_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import report

    script = tmp_path / "fake.py"
    script.write_text(
        "import json\nprint('rep 1 of 3: 2.0 s', flush=True)\nprint()\n"
        "print(json.dumps({'valid': True, 'rto_s': 2.0}))\n"
    )
    monkeypatch.setattr(report, "HERE", tmp_path)
    monkeypatch.setitem(report.BENCHES, "fake", ("fake.py", [], []))
    doc = report.run_bench("fake", quick=False)
    assert doc == {"valid": True, "rto_s": 2.0}
    out = capsys.readouterr().out
    assert "[fake   0.0 min] rep 1 of 3: 2.0 s" in out and "exited 0" in out
    assert '"rto_s"' not in out  # the JSON line is kept, not echoed
    script.write_text("import sys\nprint('half way')\nsys.exit(3)\n")
    assert report.run_bench("fake", quick=True)["invalid"] == ["fake.py exited 3, no JSON line"]
