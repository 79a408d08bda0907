from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.errors import ConfigError
from stalwart.sim import preset, simulate
from stalwart.sim.calibration import (
    CALIBRATION_VERSION,
    Calibration,
    MeasuredRun,
    apply_calibration,
    calibration_to_dict,
    load_calibration,
)


def _write(tmp_path: Path, doc: object) -> Path:
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(doc))
    return p


def _doc(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "format": "stalwart-calibration",
        "version": 1,
        "source": {"run_dir": "runs/demo", "events": 42},
        "costs": {"restart_s": 12.5, "snapshot_stall_s": 0.05, "detect_crash_s": 0.4},
        "measured": {"ettr": 0.91, "wall_s": 600.0, "failures": 3, "gpus": 4, "nodes": 2},
    }
    doc.update(over)
    return doc


def test_round_trip(tmp_path: Path) -> None:
    cal = load_calibration(_write(tmp_path, _doc()))
    assert cal.costs["restart_s"] == 12.5
    assert cal.measured == MeasuredRun(0.91, 600.0, 3, 4, 2)
    again = load_calibration(_write(tmp_path, calibration_to_dict(cal)))
    assert again == cal


def test_apply_replaces_costs_and_changes_the_result(tmp_path: Path) -> None:
    sc = preset("llama3-54d")
    cal = Calibration(costs={"restart_s": 3600.0, "sync_save_s": 120.0}, source={})
    slow = apply_calibration(sc, cal)
    assert slow.costs.restart_s == 3600.0 and slow.job.sync_save_s == 120.0
    assert slow.costs.detect_crash_s == sc.costs.detect_crash_s
    base = simulate(sc, ("restart",), replicas=10).results[0].ettr
    worse = simulate(slow, ("restart",), replicas=10).results[0].ettr
    assert worse < base - 0.05


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        (_doc(format="other"), "not a calibration file"),
        (_doc(version=CALIBRATION_VERSION + 1), "upgrade stalwart"),
        (_doc(costs={"restart_sec": 1.0}), "unknown cost"),
        (_doc(costs={"restart_s": -1.0}), "restart_s must be a finite number >= 0"),
        (_doc(costs={"restart_s": "fast"}), "must be a number"),
        (_doc(measured={"ettr": 1.5, "wall_s": 1, "failures": 0, "gpus": 1, "nodes": 1}), "ratio"),
        (_doc(measured={"ettr": 0.5}), "lacks"),
        (_doc(extra=1), "unknown top-level"),
        ([], "expected a JSON object"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, doc: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_calibration(_write(tmp_path, doc))


def test_unreadable_and_invalid_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read calibration file"):
        load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_calibration(bad)
