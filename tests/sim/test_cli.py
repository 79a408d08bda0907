from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from stalwart.cli import sim as cli_sim
from stalwart.errors import ConfigError


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stalwart")
    cli_sim.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--strategy", "restart,flash", "--replicas", "8", "--json"]
    assert _run(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scenario"] == "llama3-54d" and doc["gpus"] == 16384 and doc["replicas"] == 8
    assert [r["strategy"] for r in doc["results"]] == ["restart", "flash"]
    assert {"ettr", "ettr_ci95", "rto_s", "idle_share", "lost_h", "note"} <= set(doc["results"][0])
    assert doc["results"][1]["ettr"] > doc["results"][0]["ettr"]


def test_plan_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpus", "1024", "--ckpt-bytes", "2TB", "--write-gbps", "200"]
    argv += ["--strategy", "restart", "--replicas", "4", "--out", str(tmp_path / "plots")]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "Daly min" in out and "restart" in out and "1,024 GPUs" in out
    png = tmp_path / "plots" / "plan_interval.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_json_reflects_the_save_time(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--ckpt-bytes", "2TB", "--write-gbps", "100", "--strategy", "restart"]
    assert _run([*argv, "--replicas", "4", "--json"]) == 0
    (restart,) = json.loads(capsys.readouterr().out)["strategies"]
    assert restart["stall_s"] == pytest.approx(20.0)


def test_simulate_writes_both_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--preset", "meta-rsc2", "--strategy", "restart,elastic", "--days", "5"]
    assert _run([*argv, "--replicas", "4", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    for name in ("ettr_vs_interval.png", "ettr_vs_scale.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["simulate", "--gpus", "0"], "--gpus must be >= 1"),
        (["simulate", "--gpus", "1001"], "whole number of 8-GPU nodes"),
        (["simulate", "--preset", "nope"], "unknown preset 'nope'"),
        (["simulate", "--mtbf-hours", "-2"], "--mtbf-hours must be > 0"),
        (["simulate", "--failures-per-1000-node-days", "-1"], "cannot be negative"),
        (["simulate", "--strategy", "restart,warp"], "unknown strategy 'warp'"),
        (["plan", "--ckpt-bytes", "2XB", "--write-gbps", "1"], "cannot read size"),
        (["plan", "--ckpt-bytes", "2TB"], "go together"),
        (["simulate", "--days", "0"], "--days > 0"),
        (["simulate", "--replicas", "1"], "--replicas must be >= 2"),
        (["simulate", "--restart-s", "-5"], "restart_s must be a finite number >= 0"),
        (["simulate", "--calibration", "/nonexistent.json"], "cannot read calibration file"),
    ],
)
def test_bad_flags_raise_config_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _run(argv)


def test_main_prints_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    from stalwart.cli.main import main

    assert main(["simulate", "--gpus", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stalwart: error: --gpus must be >= 1")


def test_parse_bytes() -> None:
    assert cli_sim.parse_bytes("2TB") == 2e12
    assert cli_sim.parse_bytes("1.5GiB") == 1.5 * 2**30
    assert cli_sim.parse_bytes("100") == 100


@pytest.mark.process  # a fresh interpreter (tests/_tiers.py)
def test_importing_the_simulator_loads_neither_matplotlib_nor_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, stalwart.sim, stalwart.cli.sim; "
        "print(sorted({'matplotlib', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
