"""bench/routes.py in process, with compare stubbed: a route that met fewer faults than
asked is invalid and out of "best"; a run whose trace never fired prints valid false and
no best route; the job is sized from the trace's F-th fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stalwart.chaos.trace import compile_trace
from stalwart.metrics.routes import RouteRun, StepRecord, compare_document, route_figures

ROUTES = ("torchrun", "restart", "flash")


@pytest.fixture
def routes(harness: ModuleType) -> ModuleType:
    import routes as mod

    return mod


def _records(start: float, steps: int, step_s: float) -> tuple[StepRecord, ...]:
    return tuple(StepRecord(i, (0, 0), start + i * step_s, 1.0) for i in range(1, steps + 1))


def _never_fired_doc(target: int) -> dict[str, Any]:
    """compare's document, built by compare's own figures, for runs whose trace's one
    fault (due 1000 s after the first step) never fired: the job ended after 5 s."""
    rows = []
    for name in ROUTES:
        recs = _records(100.0, target, 0.1)
        run = RouteRun(name, 4, 0, target, 99.0, 106.0, 0, recs, planned_at=(1000.0,))
        free = RouteRun(name, 4, 0, target, 99.0, 106.0, 0, recs)
        rows.append(route_figures(run, free))
    return compare_document({}, {}, rows, {}, {})


def _row(ttt: float, free: float, faults: int, ettr: float) -> dict[str, Any]:
    return {
        "time_to_target_s": ttt, "fault_free_s": free, "faults": faults, "ettr": ettr,
        "rto_p50_s": 1.0, "rto_p95_s": 2.0, "met_faults": faults > 0, "note": "",
    }  # fmt: skip


def _main(routes: ModuleType, capsys: pytest.CaptureFixture[str], tmp: Path) -> dict[str, Any]:
    argv = ["--step-s", "0.1", "--routes", ",".join(ROUTES), "--out", str(tmp), "--reps", "1"]
    assert routes.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    doc: dict[str, Any] = json.loads(last)
    return doc


def test_a_trace_that_never_fires_is_invalid_with_no_best(
    routes: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(routes, "run_compare", lambda cmd: _never_fired_doc(50))
    doc = _main(routes, capsys, tmp_path)
    assert doc["valid"] is False
    assert "best" not in doc and "best_vs_torchrun" not in doc
    assert all(doc["routes"][n]["faults"] == 0 for n in ROUTES)
    assert any("routes.flash: met 0 faults" in r for r in doc["invalid"])


def test_a_route_short_of_faults_is_left_out_of_best(
    routes: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    doc_in = {
        "routes": {
            "torchrun": _row(100.0, 60.0, 6, 0.7),
            "restart": _row(90.0, 60.0, 5, 0.75),
            "flash": _row(70.0, 60.0, 2, 0.95),  # fastest, but met 2 of the 5 asked
        },
        "absent": {},
    }
    monkeypatch.setattr(routes, "run_compare", lambda cmd: doc_in)
    doc = _main(routes, capsys, tmp_path)
    assert doc["best"] == "restart"
    assert doc["best_vs_torchrun"] == pytest.approx(0.9)
    assert doc["best_lost_vs_torchrun"] == pytest.approx((0.25 * 90.0) / (0.3 * 100.0))
    assert doc["routes"]["restart"]["badput"] == pytest.approx(0.25)
    assert doc["routes"]["restart"]["lost_per_fault_s"] == pytest.approx(0.25 * 90.0 / 5)
    assert doc["routes"]["restart"]["extra_vs_fault_free_s"] == pytest.approx(30.0)
    assert doc["valid"] is False and doc["spread"]["routes.flash.ettr"]["valid"] is False
    assert doc["spread"]["routes.restart.ettr"]["valid"] is True


def test_a_peer_short_of_faults_gives_no_ratio_against_it(
    routes: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    doc_in = {
        "routes": {"torchrun": _row(100.0, 60.0, 1, 0.7), "restart": _row(90.0, 60.0, 5, 0.75)},
        "absent": {},
    }
    monkeypatch.setattr(routes, "run_compare", lambda cmd: doc_in)
    doc = _main(routes, capsys, tmp_path)
    assert doc["best"] == "restart"
    assert "best_vs_torchrun" not in doc and "best_lost_vs_torchrun" not in doc
    assert "lost_vs_torchrun" not in doc["routes"]["restart"]


def test_sized_by_the_trace_fth_fault(routes: ModuleType) -> None:
    steps, trace = routes.size_steps("kill every=20s", 0, 5, 0.1)
    fifth = sorted(f.t_s for f in trace.faults)[4]
    assert steps * 0.1 >= routes.SAFETY * fifth - 0.1
    same = compile_trace("kill every=20s", seed=0, ranks=4, horizon_s=trace.horizon_s)
    assert same.faults == trace.faults  # compare replays exactly this trace
    assert trace.horizon_s >= 8 * steps * 0.1  # over the job's span, not a day of faults
    slower, _ = routes.size_steps("kill every=20s", 0, 5, 0.2)
    assert slower < steps  # a slower machine needs fewer steps for the same faults


def test_a_trace_with_too_few_faults_is_refused(
    routes: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--step-s", "0.1", "--trace", "kill every=30000s", "--out", str(tmp_path)]
    assert routes.main(argv) == 2
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["valid"] is False and "fewer than --faults 5" in doc["error"]


def test_a_warm_up_past_its_timeout_still_prints_the_final_line(
    routes: ModuleType,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def slow(steps: int, work: Path) -> float:
        raise subprocess.TimeoutExpired(["torchrun"], 600)

    monkeypatch.setattr(routes, "warm_up", slow)
    assert routes.main(["--out", str(tmp_path)]) == 2
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["valid"] is False and "timed out after 600" in doc["error"]


def test_bench_dir_on_path() -> None:
    assert any(Path(p).name == "bench" for p in sys.path)


def test_reuse_needs_the_runs_folder_and_its_size(routes: ModuleType, tmp_path: Path) -> None:
    assert routes.main(["--reuse", "--out", str(tmp_path)]) == 2
    assert "--reuse" in routes._command(10, 0.1, tmp_path / "t.json", "flash", tmp_path, True)
    assert "--reuse" not in routes._command(10, 0.1, tmp_path / "t.json", "flash", tmp_path)
