"""The store requests of real agents and workers in a steady job (issue 31), counted by a
real etcd (its /metrics): what the scale bench's emulator leaves out (the agent's
detectors, the runtime's workers) is counted here.

A request a turn of the agent's 20 ms loop (the exit watch reading the ``finished``
record did: 50 a second per node) or a read a 0.1 s store poll (10 a second) shows at
once against the steady floor: keepalives at lease / 4, a long-poll per watch per 5 s, a
write and a few reads per 3 s straggler window."""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from _load import wait_until
from coordinator.etcd_server import running_etcd

from ._launch import reap_agents, start_etcd_agents

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"
STEADY_STEPS = 150  # ~10 s of 60 ms steps: the window the requests are counted over
# per node per second, agent and its one worker together: 2.7 measured on a quiet machine
# (47 while the exit watch read the store every loop turn); a read per 0.1 s poll adds 10
LIMIT = 8.0

_STARTED = re.compile(r'^grpc_server_started_total\{[^}]*grpc_method="(\w+)"[^}]*\} (\S+)$', re.M)


def _requests(url: str) -> float:
    """Every gRPC call etcd started (the HTTP gateway's calls are gRPC calls inside)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(v) for _, v in _STARTED.findall(text))


def _steps(log: Path) -> int:
    try:
        return len(log.read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_a_steady_job_asks_the_store_a_few_times_a_second_per_node(tmp_path: Path) -> None:
    job = f"load-{uuid.uuid4().hex[:8]}"
    run_dir, log = tmp_path / "run", tmp_path / "steps.jsonl"
    script = [str(SCRIPT), "--steps", "100000", "--size-mb", "1", "--step-ms", "60"]
    with running_etcd() as etcd:
        url = f"etcd://127.0.0.1:{etcd.client_port}/{job}"
        agents = start_etcd_agents(
            url, run_dir, [*script, "--step-log", str(log)], nnodes=2, nproc=1
        )
        try:
            assert wait_until(lambda: _steps(log) >= 40, 120), "the job never reached step 40"
            before, t0, s0 = _requests(etcd.url), time.monotonic(), _steps(log)
            assert wait_until(lambda: _steps(log) >= s0 + STEADY_STEPS, 120)
            after, t1 = _requests(etcd.url), time.monotonic()
        finally:
            for agent in agents:
                agent.terminate()
            reap_agents(agents, job, 60)
    rate = (after - before) / (t1 - t0) / 2
    assert rate <= LIMIT, f"{rate:.1f} store requests a second per node in a steady job"
