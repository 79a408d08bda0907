"""An agent the job refuses (its node was lost and blocklisted, and someone starts it
again) leaves without touching the job: on one host every node's snapshot slots share
/dev/shm, and the lost node's ranks now run on node 0 under the same names. Found by
bench/soak.py: the refused agent's teardown deleted the adopted rank's slots, its worker
crashed, no step was common any more and the job went back to step 0."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _load import scaled, wait_job

from stalwart.cli.run import EXIT_NOT_ADMITTED

from ._launch import events_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, kind: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if path.exists() and any(
            json.loads(line).get("kind") == kind
            for line in path.read_text().splitlines()
            if line.endswith("}")
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event in {path}")


@pytest.mark.timeout(240)
def test_a_refused_agent_leaves_the_adopted_ranks_alone(tmp_path: Path) -> None:
    job, run_dir = f"test-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--rdzv-id", job]
    cmd += ["--run-dir", str(run_dir), "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{_port()}", "--snapshot-every", "5"]
    cmd += ["--replica-rate", "50", "--standby", "--chaos", "kill node=1 at=step:40"]
    script = [str(EXAMPLE), "--steps", "400", "--size-mb", "1", "--step-ms", "40"]
    procs = [
        subprocess.Popen(
            [*cmd, "--node-rank", str(n), *script],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    again = None
    try:
        _wait_for(run_dir / "events.jsonl", "recovery_end", time.monotonic() + scaled(120))
        again = subprocess.run(
            [*cmd, "--node-rank", "1", *script], capture_output=True, text=True, timeout=scaled(120)
        )
        _, err0 = wait_job(procs[0], 150, [run_dir / "events.jsonl"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert again.returncode == EXIT_NOT_ADMITTED, again.stderr[-2000:]
    assert "blocklisted" in again.stderr and "goes on without this node" in again.stderr
    assert procs[0].returncode == 0, err0[-3000:]
    events = events_of(run_dir)
    faults = [f["fault"] for k, f in events if k == "fault_detected"]
    assert faults == ["node_loss"], err0[-3000:]  # nothing crashed after the refused start
    assert [f["status"] for k, f in events if k == "run_end"] == ["ok"]
    assert not [p for p in Path("/dev/shm").iterdir() if job in p.name]
