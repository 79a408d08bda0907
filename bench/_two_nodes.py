"""Two `stalwart run` agents on loopback sharing one coordinator: the launch code of the
benches that run a 2-node job (bench/flood.py, bench/node_loss.py, bench/soak.py).

Each agent is one ``stalwart run ... --node-rank N script args`` process, started in its
own process group, so that a node can be lost the way a machine is lost: its agent,
zygote, workers and standbys SIGKILLed at once from outside (:meth:`TwoNodes.kill`), and
started again later with the same command (:meth:`TwoNodes.start`).

A process group, not a session: with the kernel's autogroup scheduling (on here, and by
default on desktop and many server kernels) every session is a scheduling group of its
own, and CPU is shared fairly between groups, not between processes. Two agents in two
sessions on a 2-core machine are two nodes of one core each, and every byte an agent
replicates is CPU taken from its own two workers: the replication overhead of
bench/node_loss.py read 1.04-1.07 that way against 1.02-1.03 with both nodes in the
bench's group (the same code, bisected to this launch's first version). The benches'
figures are taken with the machine's CPUs shared by every process, as they were when
their bars were set. The agents'
stderr goes to ``ROOT/TAG.node<N>.err`` (appended to when a node is started again), kept
for whoever has to read why a run failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["STALWART", "TwoNodes", "events", "free_port", "read_jsonl", "remove_job_shm"]

STALWART = str(Path(sys.executable).parent / "stalwart")


def free_port() -> int:
    """A loopback port nobody listens on now (the store's, etcd's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` ([] if absent); a torn line (a writer killed mid-line)
    is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``events.jsonl`` (docs/events.md)."""
    return read_jsonl(run_dir / "events.jsonl")


def job_shm(job: str) -> list[Path]:
    """What the job has in /dev/shm (slots, boards, journals: every name starts with
    ``stalwart-<job>``)."""
    return sorted(Path("/dev/shm").glob(f"stalwart-{job}*"))


def remove_job_shm(job: str) -> list[Path]:
    """Remove what the job left in /dev/shm; returns what was there."""
    left = job_shm(job)
    for path in left:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return left


class TwoNodes:
    """One 2-node job: ``rdzv`` names the shared coordinator (``--rdzv etcd://...``, or
    ``--rdzv-id JOB --rdzv-endpoint 127.0.0.1:PORT`` for node 0's embedded store),
    ``launch`` the other ``stalwart run`` flags, ``script`` the training script and its
    arguments."""

    def __init__(
        self,
        job: str,
        run_dir: Path,
        root: Path,
        tag: str,
        rdzv: list[str],
        launch: list[str],
        script: list[str],
    ) -> None:
        self.job, self.run_dir, self.root, self.tag = job, run_dir, root, tag
        if any(a.startswith(("etcd://", "etcds://")) for a in rdzv):
            # a plain etcd: the job token stays in a file of the job's (docs/security.md)
            rdzv = [*rdzv, "--token-file", str(root / f"{tag}.job-token")]
        self.cmd = [STALWART, "run", *rdzv, "--run-dir", str(run_dir), "--nnodes", "2", *launch]
        self.script = script
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.finished: dict[int, list[int]] = {0: [], 1: []}  # exit codes of earlier agents

    def start(self, node: int) -> subprocess.Popen[bytes]:
        """Start node ``node``'s agent (again, after a :meth:`kill`)."""
        if node in self.procs and self.procs[node].poll() is None:
            raise RuntimeError(f"node {node}'s agent is still running")
        if node in self.procs:
            self.finished[node].append(self.procs.pop(node).returncode)
        with open(self.root / f"{self.tag}.node{node}.err", "a") as err:
            self.procs[node] = subprocess.Popen(
                [*self.cmd, "--node-rank", str(node), *self.script],
                stdout=subprocess.DEVNULL,
                stderr=err,
                process_group=0,  # its own group (kill() takes the node); the bench's session
            )
        return self.procs[node]

    def start_all(self) -> None:
        for node in (0, 1):
            self.start(node)

    def alive(self, node: int) -> bool:
        return node in self.procs and self.procs[node].poll() is None

    def kill(self, node: int) -> None:
        """Lose node ``node``: SIGKILL its agent's whole process group (agent, zygote,
        workers, standbys) at once, as a machine that loses power; reaps the agent."""
        proc = self.procs[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def wait(self, timeout: float) -> list[int | None]:
        """Wait for both agents to exit; their exit codes (None: still running)."""
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        return self.codes

    @property
    def codes(self) -> list[int | None]:
        return [self.procs[n].poll() if n in self.procs else None for n in (0, 1)]

    def stop(self) -> list[Path]:
        """End what still runs (SIGTERM: the agents' own teardown, then SIGKILL of the
        group), then remove what the job left in /dev/shm; returns what was left there."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return remove_job_shm(self.job)
