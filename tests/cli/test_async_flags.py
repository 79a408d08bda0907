"""`stalwart run --strategy async`'s flags: one line for every bad combination, nothing
written; a script's own flags are never read as abbreviations of the launcher's."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stalwart.cli._async_flags import async_flags, outer_settings
from stalwart.cli.main import build_parser, main


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return path


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--nproc-per-node", "4", "--replica-groups", "3"], "does not divide the 4 workers"),
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "--replica-groups", "1"],
            "groups that fit in a node",
        ),
        (["--nproc-per-node", "2", "--persist-every", "auto"], "give a number of steps"),
        (["--outer", "localsgd", "--outer-lr", "0.5"], "drop --outer-lr"),
        (["--outer-momentum", "1.0"], "--outer-momentum=1.0 is out of bounds (need < 1)"),
        (["--sync-every", "0"], "--sync-every=0 is out of bounds (need >= 1)"),
    ],
)
def test_bad_async_flags_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], script: Path, flags: list[str], needle: str
) -> None:
    run_dir = tmp_path / "run"
    args = ["run", "--run-dir", str(run_dir), "--strategy", "async", *flags, str(script)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert not run_dir.exists()


def test_outer_presets() -> None:
    p = argparse.ArgumentParser()
    async_flags(p)
    assert outer_settings(p.parse_args(["--outer", "localsgd"])) == (1.0, 0.0)
    assert outer_settings(p.parse_args([])) == (0.7, 0.9)
    assert outer_settings(p.parse_args(["--outer-lr", "0.5"])) == (0.5, 0.9)


def test_a_script_flag_is_not_an_abbreviation_of_a_launcher_flag(script: Path) -> None:
    args = build_parser().parse_args(["run", str(script), "--out", "x", "--sync", "3"])
    assert args.script_args == ["--out", "x", "--sync", "3"]
    assert args.sync_every == 50
