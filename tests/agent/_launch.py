"""Run `stalwart run` as a bounded subprocess for the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from stalwart.metrics.events import read_events

__all__ = ["events_of", "stalwart_run"]


def stalwart_run(
    run_dir: Path, args: list[str], *, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    job = f"test-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable,
        "-m",
        "stalwart.cli.main",
        "run",
        "--rdzv-id",
        job,
        "--run-dir",
        str(run_dir),
        *args,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(run_dir.parent)
    )
    leftovers = [p for p in os.listdir("/dev/shm") if job in p]
    assert not leftovers, f"shared memory left behind: {leftovers}"
    return proc


def events_of(run_dir: Path) -> list[tuple[str, dict[str, object]]]:
    res = read_events(str(run_dir / "events.jsonl"))
    assert not res.problems, res.problems
    return [(e.kind, e.fields) for e in res.events]
