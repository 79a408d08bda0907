"""bench/partition.py's torchrun arm, in process: which cells run beside the stalwart
cells, what its figures are from a rank-0 step log, the comparison in the final JSON
line, and that stopping a job reaps workers started in sessions of their own (as
torchrun starts its workers)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SLEEPER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def _args(**kw: Any) -> argparse.Namespace:
    base = {"all": False, "quick": False, "cells": "", "no_torchrun": False}
    return argparse.Namespace(**(base | kw))


def test_every_fault_of_the_chosen_cells_runs_under_torchrun_too() -> None:
    import partition

    assert partition.select(_args()) == [
        "p3/flash/embedded", "perm/elastic/embedded", "p3/torchrun/c10d", "perm/torchrun/c10d",
    ]  # fmt: skip
    assert partition.select(_args(quick=True)) == ["p3/flash/embedded", "p3/torchrun/c10d"]
    chosen = partition.select(_args(cells="perm/elastic/*"))
    assert chosen == ["perm/elastic/embedded", "perm/elastic/etcd", "perm/torchrun/c10d"]
    assert partition.select(_args(no_torchrun=True)) == partition.DEFAULT
    assert "partition 1->0:29500" in partition.fault_spec("cp30", "c10d")


def _job(tmp_path: Path, lines: list[str], ended: dict[int, float]) -> Any:
    from _partition_torchrun import TorchrunJob

    job = TorchrunJob(None, tmp_path, [0, 1])
    job.log_path.write_text("\n".join(lines) + "\n")
    job.ended_at.update(ended)
    return job


def test_torchrun_figures_from_its_step_log(tmp_path: Path) -> None:
    from _partition_torchrun import STOPPED, measure

    steps = [f'{{"step": {s}, "t": {100 + s * 0.1}}}' for s in range(1, 41)]
    hung = _job(tmp_path, ['{"start": 99.0, "restart": 0}', *steps], {})
    r = measure(hung, [STOPPED, STOPPED], t_fault=104.05, t_end=224.0, cap_s=120)
    assert r["detect_s"] is None and r["recover_s"] is None and r["capped"]
    assert r["gap_s"] == 120.0  # from the last step (104.0) to the stop
    assert r["step_ms"] == 100.0 and r["outcome"].startswith("node 0 still running 120 s")
    again = [f'{{"step": {s}, "t": {130 + s * 0.1}}}' for s in range(21, 301)]
    restarted = ['{"start": 125.0, "restart": 1}', *again]
    ok = _job(tmp_path, ['{"start": 99.0, "restart": 0}', *steps, *restarted], {})
    r = measure(ok, [0, 0], t_fault=104.05, t_end=170.0, cap_s=120)
    assert r["detect_s"] == 20.95 and r["recover_s"] == 28.05 and r["redone"] == 20
    assert r["outcome"] == "ok" and r["restarts"] == 1 and not r["capped"]


def test_the_comparison_sets_each_cell_beside_torchrun_under_the_same_fault() -> None:
    import partition

    results = {
        "perm/elastic/embedded": {"detect_s": 6.0, "gap_s": 12.0, "outcome": "ok"},
        "perm/torchrun/c10d": {"detect_s": None, "gap_s": 120.0, "capped": True,
                               "outcome": "node 0 still running"},
        "p3/flash/embedded": {"detect_s": None, "gap_s": 4.0, "outcome": "ok"},
    }  # fmt: skip
    vs = partition.versus(results)
    assert list(vs) == ["perm/elastic/embedded"]  # p3 has no torchrun cell here
    assert vs["perm/elastic/embedded"]["gap_ratio"] == 0.1
    assert vs["perm/elastic/embedded"]["torchrun_capped"] is True


class _Lab:
    def popen(self, host: int, argv: list[str], cwd: str, **kw: Any) -> subprocess.Popen[str]:
        marker = Path(cwd) / f"child{host}"
        return subprocess.Popen([sys.executable, "-c", SLEEPER, str(marker)], cwd=cwd, **kw)


def test_stopping_the_job_reaps_workers_in_sessions_of_their_own(tmp_path: Path) -> None:
    from _partition_torchrun import STOPPED, TorchrunJob

    job = TorchrunJob(_Lab(), tmp_path, [0, 1]).start()
    try:
        deadline = time.monotonic() + 60
        markers = [tmp_path / "child0", tmp_path / "child1"]
        while not all(m.exists() and m.read_text() for m in markers):
            assert time.monotonic() < deadline, "the fake launchers never started their workers"
            time.sleep(0.05)
        children = [int(m.read_text()) for m in markers]
        assert job.wait(cap_s=0.1) == [STOPPED, STOPPED]
    finally:
        job.stop()  # (a second stop kills nothing: every launcher has ended)
    for pid in children:  # killed by pid: a zombie of an exited parent is reaped by init
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, f"worker {pid} outlived the stop"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _no_stray(tmp_path: Path) -> Any:
    yield
    for marker in tmp_path.glob("child*"):  # never leave a sleeper behind a failed test
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(marker.read_text()), 9)
