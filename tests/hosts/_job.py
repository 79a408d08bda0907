"""A stalwart job across the hosts of a lab, started with the documented flags only
(docs/launch.md: ``--nnodes N --node-rank K --rdzv-endpoint HOST:PORT`` or ``--rdzv
etcd://...``, one shared ``--run-dir``), every agent reaped within a bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _load import scaled

from ._lab import Lab

__all__ = [
    "EXAMPLE",
    "STORE_PORT",
    "HostJob",
    "bumps",
    "newest_checkpoint",
    "old_generation_steps",
    "refused_commits",
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"
_CLI = [sys.executable, "-m", "stalwart.cli.main"]
STORE_PORT = 29400
"""Node 0's embedded store (``--rdzv-endpoint h0:29400``): the control plane's port."""


@dataclass
class HostJob:
    """``len(hosts)`` agents, agent K on lab host ``hosts[K]``, ``nproc`` workers each."""

    lab: Lab
    work: Path
    """The shared directory: the run dir, the ranks' digests and rank 0's step log."""
    hosts: list[int]
    script_args: list[str]
    flags: list[str] = field(default_factory=list)
    """More ``stalwart run`` flags (``--strategy``, ``--persist-every``, ...)."""
    nproc: int = 2
    rdzv: str | None = None
    """``etcd://...`` (None: node 0's embedded store at ``h<hosts[0]>:STORE_PORT``)."""
    script: Path = EXAMPLE
    """The training script (its own arguments: ``script_args``, then ``tail``)."""
    tail: list[str] | None = None
    """The script's last arguments (None: the sharded example's ``--out`` and
    ``--step-log`` under ``work``)."""
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    @property
    def step_log(self) -> Path:
        return self.work / "steps.jsonl"

    def argv(self, node: int) -> list[str]:
        where = (
            # a plain etcd: the token stays in a file of the job's (docs/security.md)
            ["--rdzv", self.rdzv, "--token-file", str(self.work / "job-token")]
            if self.rdzv
            else ["--rdzv-endpoint", f"h{self.hosts[0]}:{STORE_PORT}", "--rdzv-id", "hostjob"]
        )
        return [
            sys.executable,
            *("-m", "stalwart.cli.main", "run"),
            *("--nnodes", str(len(self.hosts)), "--node-rank", str(node)),
            *where,
            *("--run-dir", str(self.run_dir), "--nproc-per-node", str(self.nproc)),
            *self.flags,
            str(self.script),
            *self.script_args,
            *(
                ["--out", str(self.work / "sha"), "--step-log", str(self.step_log)]
                if self.tail is None
                else self.tail
            ),
        ]

    def start(self) -> HostJob:
        self.work.mkdir(parents=True, exist_ok=True)
        for node, host in enumerate(self.hosts):
            self.procs.append(
                self.lab.popen(
                    host,
                    self.argv(node),
                    cwd=str(self.work),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        return self

    def wait_step(self, step: int, timeout: float) -> None:
        """Until rank 0 logged ``step`` (a job that ended first, or the deadline: fail
        with what the agents said). ``timeout`` is sized for a quiet machine and scaled
        by the load (tests/_load.py)."""
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if any(s >= step for s, _, _ in self.steps()):
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        errs = self.stop()
        raise AssertionError(f"rank 0 never logged step {step}; the agents: {errs}")

    def wait(self, timeout: float) -> list[tuple[int, str]]:
        """Every agent's (exit code, stderr); one still running at ``timeout`` s from now
        is stopped (SIGTERM, then SIGKILL) and reported as 124 (``timeout`` scaled by
        the load, as every wait of the suite: tests/_load.py)."""
        deadline = time.monotonic() + scaled(timeout)
        out = []
        for p in self.procs:
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out.append((p.returncode, err))
            except subprocess.TimeoutExpired:
                out.append((124, self._end(p)))
        return out

    def stop(self) -> list[str]:
        """End every agent still running (the fixture's finalizer); their stderr tails."""
        return [self._end(p)[-1500:] for p in self.procs if p.returncode is None]

    @staticmethod
    def _end(p: subprocess.Popen[str]) -> str:
        if p.poll() is None:
            p.terminate()
        try:
            _, err = p.communicate(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        return err or ""

    def steps(self) -> list[tuple[int, float, int]]:
        """Rank 0's (step, time, generation) lines, in order."""
        if not self.step_log.exists():
            return []
        rows = []
        for line in self.step_log.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # the line being written
            rows.append((int(doc["step"]), float(doc["t"]), int(doc["gen"])))
        return rows

    def digests(self) -> list[str]:
        world = len(self.hosts) * self.nproc
        return [(self.work / f"sha.rank{r}").read_text() for r in range(world)]

    def shm_left(self) -> dict[str, list[str]]:
        """What the job left in each host's /dev/shm (nothing, when it cleaned up)."""
        left = {}
        for host in self.hosts:
            h = self.lab.hosts[host]
            if h.holder is not None and h.holder.poll() is None:
                names = sorted(p.name for p in h.shm.iterdir())
                if names:
                    left[h.name] = names
        return left


def bumps(run_dir: Path) -> dict[int, float]:
    """generation -> when an agent first recorded it (``generation`` events; every events
    file under the run dir, since the test's run dir holds this run only)."""
    first: dict[int, float] = {}
    for doc in _events(run_dir):
        if doc.get("kind") == "generation" and isinstance(doc.get("generation"), int):
            gen, t = doc["generation"], float(doc["t"])
            first[gen] = min(t, first.get(gen, t))
    return first


def _events(run_dir: Path) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(run_dir.rglob("events*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if isinstance(doc, dict):
                docs.append(doc)
    return docs


def old_generation_steps(job: HostJob) -> list[tuple[int, float, int]]:
    """Rank 0's steps completed in a generation the job had already left: logged in
    generation g after a later generation was recorded, past the one step that may have
    been in flight at the bump (a split brain: members of the old generation training on)."""
    first = bumps(job.run_dir)
    late = []
    for step, t, gen in job.steps():
        newer = [when for g, when in first.items() if g > gen]
        if newer and t > min(newer):
            late.append((step, t, gen))
    return late[1:]


def refused_commits(run_dir: Path) -> dict[tuple[int, int], list[int]]:
    """(rank, pid) -> the steps whose commit was refused (``persist_end`` not ok). A
    fenced member may see one refused commit and must then stop; more from one process
    is a member training on in a generation the job left."""
    out: dict[tuple[int, int], list[int]] = {}
    for doc in _events(run_dir):
        if doc.get("kind") == "persist_end" and not doc.get("ok"):
            out.setdefault((int(doc["rank"]), int(doc["pid"])), []).append(int(doc["step"]))
    return out


def newest_checkpoint(run_dir: Path, rank: int) -> int | None:
    """The newest committed checkpoint of ``rank`` (``stalwart ckpt ls``), None: none."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stalwart.cli.main",
            "ckpt",
            "ls",
            str(run_dir / "ckpt" / f"rank{rank}"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    if proc.returncode != 0:
        return None
    steps = [c["step"] for c in json.loads(proc.stdout)["checkpoints"] if c.get("ok")]
    return max(steps, default=None)
