"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _load import scaled
from _s3_server import MotoServer, running_moto


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MB tmpfs (a disk or /dev/shm that fills up), unmounted after the test;
    skipped where mounting needs a root this process is not."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount an 8 MB tmpfs here ({r.stderr.strip()}); needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=scaled(30))


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    """One moto S3 server for the session (tests/checkpoint/_s3_server.py)."""
    with running_moto() as server:
        yield server
