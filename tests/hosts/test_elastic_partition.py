"""A permanent partition between two hosts under ``--strategy elastic`` (issue 25, item
4), with node 0's embedded store and with etcd on a third host (item 3: both nodes keep
their leases, the watched data plane finds the cut). Expected: the cut node is fenced
(exit 3), the survivors on node 0 leave the collective of the generation the job left
and shrink without waiting for the collective timeout, and the job finishes ``ok``.

Elastic shrinks, so the final parameters are not compared with a fault-free run here;
the flash cells (test_partition.py) compare them bit for bit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from coordinator.etcd_server import require_etcd

from stalwart.metrics.events import read_events

from ._etcd import etcd_on
from ._job import HostJob
from ._lab import Lab

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"
STEPS = 400
FAULT_AT = 40
ARGS = ["--steps", str(STEPS), "--step-sleep", "0.05"]
FLAGS = ["--strategy", "elastic", "--nnodes", "1:2"]

pytestmark = [pytest.mark.hosts, pytest.mark.matrix, pytest.mark.timeout(600)]


def _steps(trace: Path) -> int:
    """The newest step any rank traced (0: none yet)."""
    newest = 0
    for path in trace.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                newest = max(newest, int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                continue  # a line being written
    return newest


def _run(lab: Lab, jobs: Callable[..., HostJob], work: Path, rdzv: str | None) -> None:
    trace = work / "trace"
    job = jobs(
        lab, work, [0, 1], ARGS, flags=FLAGS, rdzv=rdzv,
        script=EXAMPLE, tail=["--trace", str(trace)],
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while _steps(trace) < FAULT_AT:
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            raise AssertionError(f"no step {FAULT_AT} traced; the agents: {job.stop()}")
        time.sleep(0.2)
    lab.inject("partition 0<->1")
    t_cut = time.time()
    (rc0, err0), (rc1, err1) = job.wait(300)
    (work / "node0.err").write_text(err0)  # kept with the run (--basetemp) for a look
    (work / "node1.err").write_text(err1)
    assert rc0 == 0, f"node 0 rc {rc0}:\n{err0[-3000:]}\nnode 1:\n{err1[-2000:]}"
    assert rc1 == 3, f"node 1 rc {rc1}:\n{err1[-3000:]}"
    assert _steps(trace) == STEPS
    events = read_events(str(job.run_dir / "events.jsonl")).events
    assert [e["status"] for e in events if e.kind == "run_end"] == ["ok"]
    shrunk = [int(str(e["world_size"])) for e in events if e.kind == "resize"]
    assert 2 in shrunk, shrunk  # it shrank (the lost ranks may be adopted and rejoin)
    assert job.shm_left() == {}
    found = [
        e
        for e in events  # the lease's expiry (embedded store) or a decided cut (etcd)
        if e.kind == "fault_detected" or (e.kind == "note" and "data plane cut" in e["message"])
    ]
    for e in found:  # how long the cut took to find, for the log (-s; bench/partition.py)
        print(f"{e.kind} {e.t - t_cut:.2f} s after the cut: {e.get('message', '')}")
    if not found or found[0].t - t_cut > 12:  # no silent wait over ~10 s (issue 25)
        assert "have waited" in err0 + err1, "a stall over 10 s said nothing"


def test_permanent_partition_under_elastic(
    lab_factory: Callable[..., Lab], jobs: Callable[..., HostJob], tmp_path: Path
) -> None:
    _run(lab_factory(2), jobs, tmp_path, None)


def test_permanent_partition_under_elastic_and_etcd(
    lab_factory: Callable[..., Lab], jobs: Callable[..., HostJob], tmp_path: Path
) -> None:
    binary = require_etcd()
    lab = lab_factory(3)
    (tmp_path / "etcd").mkdir()
    with etcd_on(lab, 2, binary, tmp_path / "etcd" / "data") as addr:
        _run(lab, jobs, tmp_path, f"etcd://{addr}/hostjob")
