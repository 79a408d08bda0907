"""The HTML report opens in a real headless browser and its plots render.

Rule: skipped (with the reason) only when chromium is absent on a developer machine;
under CI (the ``CI`` environment variable set, as .ci/run does) a missing browser fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _load import wait_job

from stalwart.cli.main import main
from stalwart.metrics._plots import COLORS

_CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
)


def _browser() -> str:
    if _CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but chromium is missing: .ci/run installs it (apt chromium)")
        pytest.skip("chromium not installed (apt-get install chromium); CI never skips this")
    return _CHROMIUM


def _screenshot(page: Path, out: Path, tmp_path: Path) -> None:
    profile = tmp_path / "profile"
    profile.mkdir()
    cmd = [
        _browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
        "--window-size=1100,3200",
        f"--screenshot={out}",
        page.as_uri(),
    ]
    # Its own session, so that a hang kills the browser's helper processes too.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = wait_job(proc, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0 and out.exists(), err[-2000:]


def _pixels(png: Path) -> dict[tuple[int, int, int], int]:
    from PIL import Image

    with Image.open(png) as im:
        colors = im.convert("RGB").getcolors(maxcolors=1 << 24)
    assert colors is not None
    return {rgb: n for n, rgb in colors}


def _rgb(hex_color: str) -> tuple[int, int, int]:
    h = hex_color.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def test_report_renders_in_headless_chromium(make_run: Any, tmp_path: Path) -> None:
    browser = _browser()
    assert browser
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    assert main(["report", str(make_run("overlapping")), "--html", str(page)]) == 0
    _screenshot(page, shot, tmp_path)
    px = _pixels(shot)
    total = sum(px.values())
    white = px.get((255, 255, 255), 0)
    assert total - white > total // 20, "the screenshot is (nearly) blank"
    # Each plot fills large areas with bucket colours; the legend swatches in the table
    # are a few hundred pixels, so thousands of pixels of a colour mean the SVGs drew.
    for bucket in ("productive", "lost_progress", "recovery", "detection"):
        assert px.get(_rgb(COLORS[bucket]), 0) > 2000, f"no {bucket} area: plots did not render"
