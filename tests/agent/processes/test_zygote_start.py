"""The zygote's start is judged by its CPU time, not the clock (agent/config.py
``ZygoteStart``): a stuck import (no CPU) and a looping one (CPU past the budget) fail
with a line naming the flag to raise; a loaded machine, which only stretches the clock,
does not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stalwart.agent import ZygoteStart
from stalwart.agent.processes._zygote_client import ZygoteClient, ZygoteNotReady
from stalwart.errors import ConfigError


def test_bad_limits_are_refused_naming_the_flags() -> None:
    with pytest.raises(ConfigError, match="--zygote-ready-cpu 0"):
        ZygoteStart(cpu_s=0.0)
    with pytest.raises(ConfigError, match="--zygote-stall"):
        ZygoteStart(stall_s=0.5)


def _zygote(tmp_path: Path, module_body: str) -> ZygoteClient:
    """A zygote told to preload a module whose import runs ``module_body`` (the
    modules the agent names are imported without the script preload's time limit)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "ux_start_pkg.py").write_text(module_body)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return ZygoteClient(["ux_start_pkg"], env)


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(180)
def test_a_zygote_stuck_in_an_import_fails_once_it_used_no_cpu_for_the_stall(
    tmp_path: Path,
) -> None:
    zygote = _zygote(tmp_path, "import time\ntime.sleep(600)\n")
    try:
        with pytest.raises(ZygoteNotReady, match=r"used no CPU for \d+ s .*--zygote-stall 2"):
            zygote.wait_ready(cpu_s=300.0, stall_s=2.0)
    finally:
        zygote.proc.kill()
        zygote.close()


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(180)
def test_a_zygote_looping_in_an_import_fails_past_its_cpu_budget(tmp_path: Path) -> None:
    zygote = _zygote(tmp_path, "while True:\n    pass\n")
    try:
        with pytest.raises(ZygoteNotReady, match=r"s of CPU .*--zygote-ready-cpu 5"):
            zygote.wait_ready(cpu_s=5.0, stall_s=120.0)
    finally:
        zygote.proc.kill()
        zygote.close()
