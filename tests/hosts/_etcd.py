"""A real etcd server as a host of the lab (its own namespace on the bridge), so both
sides of a partition between the nodes can still reach it, as in a cluster whose etcd
runs on its own machines (issue 25: a partition between the nodes under etcd)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from _load import scaled

from ._lab import Lab

__all__ = ["CLIENT_PORT", "etcd_on"]

CLIENT_PORT = 2379


@contextlib.contextmanager
def etcd_on(lab: Lab, host: int, binary: str, data: Path) -> Iterator[str]:
    """etcd on lab host ``host``; yields its client address (``h<host>:2379``)."""
    h = lab.hosts[host]
    url = f"http://{h.addr}:{CLIENT_PORT}"
    peer = f"http://{h.addr}:2380"
    argv = [
        binary,
        f"--data-dir={data}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        "--heartbeat-interval=25",
        "--election-timeout=250",
        "--log-level=warn",
    ]
    log = open(data.parent / "etcd.log", "ab")  # noqa: SIM115  # closed below
    proc = lab.popen(host, argv, cwd=str(data.parent), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        # the health check runs in the etcd host's namespace, not ours
        check = f"import urllib.request as u; print(u.urlopen('{url}/health', timeout=2).read())"
        probe = lab.cmd(host, [sys.executable, "-c", check])
        while True:
            out = subprocess.run(probe, capture_output=True, text=True, timeout=scaled(10)).stdout
            if '"true"' in out:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd on {h.name} did not start: see {data.parent}/etcd.log")
            time.sleep(0.2)
        yield f"{h.name}:{CLIENT_PORT}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
