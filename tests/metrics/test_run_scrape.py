"""The Prometheus endpoint of a real `stalwart run` serves live figures while it trains."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from _load import scaled, wait_job

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series.split("{", 1)[0]] = float(value)  # drop the labels
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scrape_during_a_run(tmp_path: Path) -> None:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "stalwart.cli.main", "run",
        "--nproc-per-node", "2",
        "--rdzv-id", f"scrape-{uuid.uuid4().hex[:8]}",
        "--run-dir", str(tmp_path / "run"),
        "--metrics-port", str(port),
        str(_EXAMPLE), "--steps", "400",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    seen: list[float] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and len(seen) < 2:
            try:
                figures = _scrape(port)
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)  # the endpoint is not up yet: poll again
                continue
            step = figures.get("stalwart_step", 0.0)
            if step > 0 and (not seen or step > seen[-1]):
                seen.append(step)
                assert 0.0 < figures["stalwart_ettr_ratio"] <= 1.0
                assert figures["stalwart_world_size"] == 2.0
            time.sleep(0.1)
        assert len(seen) == 2, f"no live figures were served (stderr: {proc.stderr})"
        _, err = wait_job(proc, 200)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.communicate(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
