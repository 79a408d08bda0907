"""The process tree below a launcher, from /proc: a grandchild in a session of its own is
found (torchrun's workers are), and a process outside the tree never is."""

from __future__ import annotations

import os
import subprocess

import pytest
from _load import scaled

from stalwart.chaos.proctree import descendants


@pytest.mark.timeout(60)
def test_a_grandchild_in_its_own_session_is_below_the_launcher_and_the_caller_is_not() -> None:
    cmd = "setsid sleep 30 & echo $!; wait"
    launcher = subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        grandchild = int(launcher.stdout.readline())
        below = descendants(launcher.pid)
        assert grandchild in below
        assert os.getpid() not in below and launcher.pid not in below
    finally:
        for pid in descendants(launcher.pid):
            os.kill(pid, 9)
        launcher.wait(timeout=scaled(30))
    assert descendants(launcher.pid) == []  # reaped: nothing left below it
