"""`stalwart check` on two nodes on loopback: both run the paired check and the probes,
reach the same verdicts, and node 0 writes one preflight event per node."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _load import wait_job

from ._launch import events_of


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(400)
def test_two_nodes_check_each_other(tmp_path: Path) -> None:
    run = tmp_path / "chk"
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--rdzv-id", "chk"]
    cmd = [sys.executable, "-m", "stalwart.cli.main", "check", *common, "--run-dir", str(run)]
    procs = [
        subprocess.Popen(
            [*cmd, "--node-rank", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for n in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            out, err = wait_job(p, 360)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    verdicts = [[ln for ln in out.splitlines() if ln.startswith("node ") and ": " in ln[:12]]
                for _, out, _ in outs]  # fmt: skip
    assert all(rc in (0, 1) for rc, _, _ in outs), outs  # fit or not: never an error
    assert verdicts[0] and verdicts[0] == verdicts[1]  # the same verdicts on both nodes
    probes = [ln for ln in outs[1][1].splitlines() if ln.startswith("node 1 probe ")]
    assert {ln.split()[3].rstrip(":") for ln in probes} >= {"host", "shm", "disk", "nvml"}
    events = [f for k, f in events_of(run) if k == "preflight"]
    assert sorted(str(f["member"]) for f in events) == ["node0", "node1"]
    assert all(float(str(f["matmul_s"])) > 0 and float(str(f["seconds"])) > 0 for f in events)
