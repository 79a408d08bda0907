"""A real one-node Slurm cluster for tests: slurmctld and slurmd from Debian's
``slurm-wlm`` on free loopback ports, their state in a private directory, both ended by
PID afterwards.

``require_slurm()`` skips a test when the binaries are absent locally and fails it when
``CI`` is set (.ci/run installs ``slurm-wlm``), so the Slurm recipe can never silently go
untested in CI.

The configuration is the smallest Slurm accepts: ``auth/none`` and ``cred/none`` (no
munge daemon to run), process tracking by process group, no cgroups, the node's CPUs
oversubscribable so a 2-task job fits on a 2-core machine. One slurmd stands for the
allocation; the recipe's two tasks on it are stalwart's two "nodes", as two agents on
loopback are everywhere else in the tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _load import scaled

__all__ = ["SlurmCluster", "require_slurm", "running_slurm"]

_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")


def require_slurm() -> None:
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        reason = (
            f"Slurm not installed ({', '.join(missing)} missing): "
            "apt-get install -y --no-install-recommends slurm-wlm"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: {reason}", pytrace=False)
        pytest.skip(reason)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


_CONF = """\
ClusterName=stalwart-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm command (and the job it submits) runs with."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def scontrol(self, *args: str) -> str:
        out = subprocess.run(
            ["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=scaled(30)
        )
        if out.returncode != 0:
            raise AssertionError(f"scontrol {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def sbatch(self, *args: str) -> int:
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=scaled(30),
        )
        if out.returncode != 0:
            raise AssertionError(f"sbatch failed: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job_field(self, job: int, field: str) -> str:
        """One ``Field=value`` of ``scontrol show job`` (``JobState``, ``Restarts``)."""
        match = re.search(rf"\b{field}=(\S+)", self.scontrol("show", "job", str(job)))
        if match is None:
            raise AssertionError(f"no {field} for job {job}")
        return match.group(1)

    def wait_state(self, job: int, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_field(job, "JobState")
            if state in states:
                return state
            time.sleep(0.2)
        raise AssertionError(f"job {job} not in {sorted(states)} after {timeout:.0f} s")

    def cancel(self, job: int) -> None:
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", str(job)], env=self.env, timeout=scaled(30), check=False)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_slurm(root: Path) -> Iterator[SlurmCluster]:
    """slurmctld + one slurmd until the block ends; waits until the node is idle."""
    require_slurm()
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    ctld_port, d_port = _free_ports(2)
    host = socket.gethostname().split(".")[0]
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    conf = root / "slurm.conf"
    conf.write_text(
        _CONF.format(
            host=host,
            ctld_port=ctld_port,
            d_port=d_port,
            user=user,
            root=root,
            cpus=max(2, os.cpu_count() or 2),
        )
    )
    cluster = SlurmCluster(root, conf)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            with open(root / f"{daemon}.out", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [daemon, "-D", "-f", str(conf)],
                        env=cluster.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + 60
        while True:
            info = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=cluster.env, capture_output=True, text=True
            )
            if info.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                log = "\n".join(
                    (root / f"{d}.out").read_text()[-1500:] for d in ("slurmctld", "slurmd")
                )
                raise AssertionError(f"the Slurm node did not come up:\n{log}")
            time.sleep(0.2)
        yield cluster
    finally:
        if procs:
            _cancel_all(cluster)
        for proc in reversed(procs):
            _stop(proc)


def _cancel_all(cluster: SlurmCluster) -> None:
    """End every job first: a job step's slurmstepd outlives slurmd by design, so a
    job still running when the daemons stop would keep its processes."""
    env = cluster.env
    with contextlib.suppress(Exception):
        subprocess.run(["scancel", "--full", "--partition", "debug"], env=env, timeout=scaled(30))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = subprocess.run(
                ["squeue", "-h", "-o", "%i"],
                env=env,
                capture_output=True,
                text=True,
                timeout=scaled(30),
            )
            if left.returncode != 0 or not left.stdout.strip():
                return
            time.sleep(0.2)
