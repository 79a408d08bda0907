"""Addresses across hosts (issue 25, item 7), on lab hosts: a node's listeners bind the
address of its route to the rendezvous (not loopback), the c10d store binds the
rendezvous host only, and a node whose host name resolves to loopback is refused at
start in one line naming the fix."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _load import scaled

from ._job import HostJob
from ._lab import Lab

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(300)]

_PROBE = """
import socket, subprocess
from stalwart.agent.cluster._address import c10d_store, node_address, check_host_name
print(node_address("", ("h0", 29400)))
print(node_address("", ("127.0.0.1", 29400)))
port, store = c10d_store("h0")
listen = [l.split()[3] for l in subprocess.run(["ss", "-ltnH"], capture_output=True,
          text=True).stdout.splitlines() if l.split()[3].endswith(f":{port}")]
print(listen)
check_host_name(node_address("", ("h0", 29400)))
print("name ok")
"""

_REFUSE = """
from stalwart.agent.cluster._address import check_host_name, node_address
check_host_name(node_address("", ("h0", 29400)))
"""


def _on(lab: Lab, host: int, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lab.cmd(host, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )


def test_listeners_bind_the_route_to_the_rendezvous(lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(2)
    h0, h1 = lab.hosts
    out = _on(lab, 1, _PROBE.replace('c10d_store("h0")', 'c10d_store("h1")'))
    assert out.returncode == 0, out.stderr[-2000:]
    route, loop, listen, ok = out.stdout.splitlines()
    assert route == h1.addr  # host 1's address toward h0, not 127.0.0.1
    assert loop == "127.0.0.1"  # every node on one host: loopback, as before
    (bound,) = ast.literal_eval(listen)  # the c10d store's one listening socket: h1's address only
    assert bound.rsplit(":", 1)[0] == h1.addr, bound
    assert ok == "name ok"
    assert h0.addr not in out.stdout


def test_a_host_name_on_loopback_is_refused_naming_the_fix(
    lab_factory: Callable[..., Lab], jobs: Callable[..., HostJob], tmp_path: Path
) -> None:
    """Debian's installer maps the host name to 127.0.1.1: gloo would listen there."""
    lab = lab_factory(2, hosts_file_extra={1: "127.0.1.1 h1\n"})
    out = _on(lab, 1, _REFUSE)
    assert "GLOO_SOCKET_IFNAME=eth0" in out.stderr and "127.0.1.1" in out.stderr
    job = jobs(lab, tmp_path, [0, 1], ["--steps", "5"])
    node1 = job.procs[1]  # (node 0, left waiting for it, is stopped by the fixture)
    _, err = node1.communicate(timeout=scaled(120))
    assert node1.returncode == 2, err[-2000:]
    lines = [line for line in err.splitlines() if "GLOO_SOCKET_IFNAME" in line]
    assert len(lines) == 1 and "h1" in lines[0] and "127.0.1.1" in lines[0], err[-2000:]
    assert "Traceback" not in err
