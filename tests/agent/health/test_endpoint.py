"""The node's health endpoint (agent/health/endpoint.py): what /healthz and /readyz answer in
each state, over a real loopback HTTP server, and from a real `stalwart run`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _load import scaled

from stalwart.agent.health.endpoint import (
    HEALTH_FORMAT_VERSION,
    HealthEndpoint,
    HealthEndpointConfig,
    NodeStatus,
)
from stalwart.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_lm.py"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_start_up_is_live_but_not_ready_then_training_then_a_stuck_loop() -> None:
    clock = Clock()
    status = NodeStatus(node=1, clock=clock)
    endpoint = HealthEndpoint(status, HealthEndpointConfig(port=0, stale_s=30))
    clock.now += 300  # a long start-up (rendezvous, a slow zygote) is not a stuck agent
    assert endpoint.answer("/healthz")[0] == 200
    code, body = endpoint.answer("/readyz")
    assert code == 503 and body["state"] == "starting" and body["node"] == 1
    status.tick()  # the loop's first turn: the workers were started
    assert endpoint.answer("/readyz") == (
        200,
        {
            "v": HEALTH_FORMAT_VERSION,
            "ok": True,
            "node": 1,
            "state": "training",
            "detail": "this node's workers train in the job's current generation",
        },
    )
    clock.now += 29
    assert endpoint.answer("/healthz")[0] == 200
    clock.now += 2  # 31 s without a turn of the loop
    code, body = endpoint.answer("/healthz?verbose=1")
    assert code == 503 and "31.0 s" in body["detail"]
    status.ending()
    assert endpoint.answer("/readyz")[0] == 503
    assert endpoint.answer("/metrics")[0] == 404


def test_the_endpoint_serves_http_on_loopback() -> None:
    status = NodeStatus(node=0)
    endpoint = HealthEndpoint(status, HealthEndpointConfig(port=0)).start()
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        assert _get(f"{base}/readyz")[0] == 503
        status.tick()
        code, body = _get(f"{base}/readyz")
        assert code == 200 and body["ok"] is True
        assert _get(f"{base}/healthz")[0] == 200
        assert _get(f"{base}/nope")[0] == 404
    finally:
        endpoint.close()


def test_a_busy_port_and_a_bad_port_are_one_line_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = int(s.getsockname()[1])
        with pytest.raises(ConfigError, match="pass a free --health-port"):
            HealthEndpoint(NodeStatus(0), HealthEndpointConfig(port=port)).start()
    with pytest.raises(ConfigError, match="is not a TCP port"):
        HealthEndpointConfig(port=70000)


@pytest.mark.timeout(180)
def test_a_running_job_is_ready_and_live(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--run-dir", str(tmp_path / "r")]
    cmd += ["--health-port", str(port), str(EXAMPLE), "--steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 150, []
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                code, body = _get(f"http://127.0.0.1:{port}/readyz")
            except OSError:  # not listening yet
                time.sleep(0.1)
                continue
            seen.append(body["state"])
            if code == 200:
                break
            time.sleep(0.1)
        assert seen and seen[-1] == "training", (seen, proc.poll())
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 143, err[-2000:]
