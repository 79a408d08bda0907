"""The check at start: the installed torch against the tested range (stalwart.compat)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import stalwart.compat as compat


def test_the_installed_torch_is_in_the_tested_range() -> None:
    assert compat.installed_torch() == torch.__version__
    assert compat.torch_version_problem() is None, compat.torch_version_problem()


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cu128", "2.13.0a0+git1234"])
def test_a_tested_release_passes(version: str) -> None:
    assert compat.torch_version_problem(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "3.0.0", "nightly"])
def test_another_release_gets_one_line_naming_the_fix(version: str) -> None:
    problem = compat.torch_version_problem(version)
    assert problem is not None and "\n" not in problem
    assert f"torch {version} is outside" in problem
    assert "pip install 'torch>=2.13,<2.14'" in problem


def test_the_warning_is_said_once_per_process(monkeypatch: Any) -> None:
    monkeypatch.setattr(compat, "TESTED_TORCH", ((2, 99), (2, 99)))
    monkeypatch.setattr(compat, "_WARNED", [])
    said: list[str] = []
    compat.warn_untested_torch(said.append)
    compat.warn_untested_torch(said.append)
    assert len(said) == 1 and "tested with (2.99)" in said[0]


def test_the_range_is_pyprojects_bound() -> None:
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (low, high) = compat.TESTED_TORCH
    bound = f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"
    assert bound in project["project"]["dependencies"]


def test_stalwart_run_says_it(monkeypatch: Any, capsys: Any, tmp_path: Any) -> None:
    """``stalwart run`` warns before it starts anything (a bad chaos spec stops it
    right after the check, so no job starts here)."""
    from stalwart.cli.main import main
    from stalwart.errors import ConfigError

    monkeypatch.setattr(compat, "TESTED_TORCH", ((2, 99), (2, 99)))
    monkeypatch.setattr(compat, "_WARNED", [])
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with contextlib.suppress(SystemExit, ConfigError):
        main(["run", "--s3-endpoint", "http://x", str(script)])
    err = capsys.readouterr().err
    assert "stalwart: warning: torch" in err and "tested with (2.99)" in err


@pytest.mark.process
@pytest.mark.timeout(120)
def test_the_check_imports_no_torch() -> None:
    """``stalwart run`` checks before anything imports torch (the agent never does)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, stalwart.compat as c, stalwart.cli.run; "
        "assert c.installed_torch(); sys.exit('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=110)
