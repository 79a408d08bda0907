"""The coordinators bench/scale.py measures, each in its own process so that its CPU
and memory are its own: the embedded store (a :class:`StoreServer` as node 0's agent
hosts it) and one etcd member. Also run as ``python bench/_scale_backends.py serve
TOKEN_FILE MAX_CONNECTIONS``: the embedded store's process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["Backend", "ProcStats", "start_embedded", "start_etcd"]

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStats:
    cpu_s: float  # user + system CPU seconds so far
    rss_mb: float


def proc_stats(pid: int) -> ProcStats:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK
    rss = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return ProcStats(cpu, rss)


class Backend:
    """A coordinator process: where it listens and how to stop it."""

    def __init__(self, kind: str, proc: subprocess.Popen[bytes], address: str, tmp: str) -> None:
        self.kind, self.proc, self.address, self.tmp = kind, proc, address, tmp

    def stats(self) -> ProcStats:
        return proc_stats(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def start_embedded(
    max_connections: int, nice: int = 0, *, own_group: bool = True
) -> tuple[Backend, bytes]:
    """The embedded store in a process of its own at ``nice``; (backend, job token).

    ``own_group``: the store starts a session of its own. This kernel schedules by
    autogroup (``/proc/sys/kernel/sched_autogroup_enabled``), one CPU group per session:
    in the bench's session the store's one thread competed with the emulator's ~8,000
    (1,024 nodes) for the same share and got ~0.1 of a core while they waited on it; a
    group of its own gets up to a core, as node 0's agent gets its host on a real job."""
    from stalwart.coordinator import create_token_file

    tmp = tempfile.mkdtemp(prefix="scale-store-")
    token_file = os.path.join(tmp, "token")
    token = create_token_file(token_file)
    cmd = [sys.executable, __file__, "serve", token_file, str(max_connections), str(nice)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=own_group
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()  # the port, once it listens
    if not line.isdigit():
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the embedded store did not start: {line!r}")
    return Backend("embedded", proc, f"127.0.0.1:{line}", tmp), token


def start_etcd(timeout_s: float = 30.0, *, own_group: bool = True) -> Backend:
    """One etcd member on loopback (tests/coordinator/etcd_server.py's flags: a 1 s
    minimum lease TTL); ``own_group`` as :func:`start_embedded`'s."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("no etcd binary on PATH (apt-get install etcd-server)")
    tmp = tempfile.mkdtemp(prefix="scale-etcd-")
    client, peer = _free_ports(2)
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    args = [
        binary,
        f"--data-dir={tmp}/data",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=default={peer_url}",
        "--heartbeat-interval=25",
        "--election-timeout=250",
        "--log-level=error",
    ]
    with open(os.path.join(tmp, "etcd.log"), "wb") as log:
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=own_group
        )
    backend = Backend("etcd", proc, f"127.0.0.1:{client}", tmp)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", client), timeout=1.0):
                return backend
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                backend.stop()
                raise RuntimeError(f"etcd did not start; see {tmp}/etcd.log") from None
            time.sleep(0.1)


def _serve(token_file: str, max_connections: int, nice: int) -> None:
    from stalwart.coordinator import StoreServer, StoreServerConfig, read_token_file

    if nice:  # every thread of this process, the ones it starts included
        os.setpriority(os.PRIO_PROCESS, 0, nice)

    # as agent/cluster/_link.py sizes it for the job: every node's handshakes at once
    config = StoreServerConfig(
        max_connections=max_connections, max_unauthenticated=max(64, max_connections // 4)
    )
    import faulthandler
    import signal

    # kill -USR1 <pid>: every thread's stack into stacks.log beside the token
    stacks = open(os.path.join(os.path.dirname(token_file), "stacks.log"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    profile = os.environ.get("STALWART_STORE_PROFILE")
    if profile:  # where the store's CPU goes (bench/_store_profile.py)
        import _store_profile

        _store_profile.start()
        out = f"{profile}.{os.getpid()}"

        def _dump(signum: int, frame: object) -> None:  # Backend.stop terminates us
            _store_profile.dump(out)
            os._exit(0)

        signal.signal(signal.SIGTERM, _dump)
    with StoreServer(read_token_file(token_file), config).start() as server:
        print(server.port, flush=True)
        sys.stdin.read()  # until the bench closes our stdin (or ends)
    if profile:
        _store_profile.dump(out)


if __name__ == "__main__":
    _serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
