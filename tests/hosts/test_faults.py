"""The lab's network faults do what their spec says (``_net.py``), on two lab hosts and a
TCP echo server: a partition is a silent blackhole (a connect times out, no RST), a
one-way partition cuts one direction only, a port cut leaves the other ports up, every
fault heals (by itself after ``for Ns``), and a delay adds at least its delay. Cheap (no
training job): they run in ``make test``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from _load import scaled

from ._lab import Lab

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(300)]

_SERVER = """
import socket, threading
def serve(port):
    s = socket.create_server(("0.0.0.0", port), backlog=64)
    while True:
        c, _ = s.accept()
        c.sendall(b"hi"); c.close()
for p in (5001, 5002):
    threading.Thread(target=serve, args=(p,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""
_CLIENT = """
import socket, sys, time
t = time.monotonic()
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    print("ok" if s.recv(2) == b"hi" else "bad", round(time.monotonic() - t, 3))
except ConnectionRefusedError:
    print("refused", 0)
except OSError:
    print("timeout", 0)
"""


@pytest.fixture
def lab(lab_factory: Callable[..., Lab]) -> Iterator[Lab]:
    """Two hosts, each serving ports 5001 and 5002."""
    lab = lab_factory(2)
    servers = [
        lab.popen(h, [sys.executable, "-c", _SERVER], cwd="/", stdout=subprocess.PIPE)
        for h in (0, 1)
    ]
    try:
        for s in servers:
            assert s.stdout is not None and s.stdout.readline().strip() == "ready"
        yield lab
    finally:
        for s in servers:
            s.kill()
            s.communicate(timeout=scaled(10))


def _dial(lab: Lab, src: int, dst: int, port: int = 5001) -> tuple[str, float]:
    argv = [sys.executable, "-c", _CLIENT, f"h{dst}", str(port)]
    out = subprocess.run(lab.cmd(src, argv), capture_output=True, text=True, timeout=scaled(60))
    what, seconds = out.stdout.split()
    return what, float(seconds)


def test_partition_is_a_silent_blackhole_and_heals(lab: Lab) -> None:
    assert _dial(lab, 0, 1)[0] == "ok"
    lab.inject("partition 0<->1")
    assert _dial(lab, 0, 1)[0] == "timeout"  # no RST: a refused connect would be "refused"
    assert _dial(lab, 1, 0)[0] == "timeout"
    lab.heal()
    assert _dial(lab, 0, 1)[0] == _dial(lab, 1, 0)[0] == "ok"


def test_one_way_and_port_cuts(lab: Lab) -> None:
    lab.inject("partition 1->0")
    assert _dial(lab, 1, 0)[0] == "timeout"
    assert _dial(lab, 0, 1)[0] == "timeout"  # the SYN-ACK back to 0 is what 1 sends
    lab.heal()
    lab.inject("partition 1->0:5001")
    assert _dial(lab, 1, 0, 5001)[0] == "timeout"  # the control plane's port
    assert _dial(lab, 1, 0, 5002)[0] == "ok"  # the data plane stays up
    assert _dial(lab, 0, 1, 5001)[0] == "ok"  # and node 0 still reaches node 1
    lab.heal()
    assert _dial(lab, 1, 0, 5001)[0] == "ok"


def test_a_timed_fault_heals_by_itself(lab: Lab) -> None:
    lab.inject("partition 0<->1 for 1s")
    deadline = time.monotonic() + 60
    while _dial(lab, 0, 1)[0] != "ok":
        assert time.monotonic() < deadline, "the fault did not heal"


def test_full_loss_drops_everything_and_delay_adds_its_delay(lab: Lab) -> None:
    lab.inject("loss 0->1 100%")
    assert _dial(lab, 0, 1)[0] == "timeout"
    lab.heal()
    lab.inject("delay 0<->1:5001 400ms")
    what, seconds = _dial(lab, 0, 1)
    assert what == "ok" and seconds >= 0.4  # the server's reply came through the forwarder
    assert _dial(lab, 0, 1, 5002)[0] == "ok"
    lab.heal()
