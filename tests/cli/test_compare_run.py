"""`stalwart compare` for real: two routes (torchrun and flash), one kill, a small job.

What it shows: the same recorded instant strikes both routes (torchrun's by compare's own
signal, flash's by stalwart's chaos), both reach the target, and the table, the JSON and
the page are written with a recovery per route. No timing threshold: only that each route
recovered its one fault and flash lost no quality against its fault-free run.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from stalwart.cli.main import main

_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "corpus" / "nanogpt.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_routes_one_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "--routes", "torchrun,flash", "--nproc-per-node", "2", "--target", "300"]
    argv += ["--trace", "kill every=2s jitter=0 rank=1", "--horizon", "2.5", "--out", str(out)]
    argv += ["--timeout", "400", str(_SCRIPT), "--max_iters", "300", "--eval_interval", "10"]
    assert main(argv) == 0
    doc = json.loads((out / "routes.json").read_text())
    assert [f["t_s"] for f in doc["trace"]["faults"]] == [2.0]
    assert set(doc["routes"]) == {"torchrun", "flash"}
    for name, row in doc["routes"].items():
        assert row["reached"], (name, row["note"])
        assert (row["faults"], row["recovered"]) == (1, 1), name
        assert row["rto_p50_s"] > 0 and row["ettr"] > 0
    assert doc["routes"]["flash"]["loss_gap"] == 0.0  # bit-identical recovery, same losses
    assert "| torchrun | 1/1 |" in (out / "routes.md").read_text()
    assert "data:image/svg+xml" in (out / "routes.html").read_text()
    said = capsys.readouterr().out
    assert "flash/faulted: fault 1 at" in said and "torchrun/faulted: fault 1 at" in said
    assert not glob.glob("/dev/shm/stalwart-cmp-*")
