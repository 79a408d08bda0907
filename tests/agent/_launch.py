"""Run `stalwart run` as bounded subprocesses for the multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from _load import node_lease, scaled, wait_job

from stalwart.metrics.events import read_events

__all__ = [
    "events_of",
    "stalwart_run",
    "stalwart_run_nodes",
    "start_etcd_agents",
    "start_run",
    "stop_run",
]


def _cmd(job: str, run_dir: Path, args: list[str]) -> list[str]:
    return [
        *_cmd_prefix(),
        "--rdzv-id",
        job,
        "--run-dir",
        str(run_dir),
        *args,
    ]


def _check_shm(job: str) -> None:
    leftovers = [p for p in os.listdir("/dev/shm") if job in p]
    assert not leftovers, f"shared memory left behind: {leftovers}"


def stalwart_run(
    run_dir: Path, args: list[str], *, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """``timeout``: seconds on a quiet machine, scaled for the load and extended while
    the job's events file or output grows (tests/_load.py)."""
    job = f"test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = _cmd(job, run_dir, args)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(run_dir.parent),
    )
    try:
        out, err = wait_job(proc, timeout, [run_dir / "events.jsonl"])
    finally:
        _stop(proc)
    _check_shm(job)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_run(run_dir: Path, args: list[str]) -> tuple[str, subprocess.Popen[str]]:
    """`stalwart run` in the background (the caller ends it with :func:`stop_run`)."""
    job = f"test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        _cmd(job, run_dir, args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(run_dir.parent),
    )
    return job, proc


def stop_run(job: str, proc: subprocess.Popen[str]) -> None:
    """SIGTERM (the agent cleans up), then no shared memory of the job may be left."""
    _stop(proc)
    _check_shm(job)


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM first: the agent then cleans up its workers and shared memory."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stalwart_run_nodes(
    run_dir: Path,
    nnodes: int,
    args: list[str],
    *,
    timeout: float = 120.0,
    per_node: dict[int, list[str]] | None = None,
) -> list[tuple[int, str]]:
    """One agent per node on loopback; returns (returncode, stderr) per node.
    ``per_node``: more flags for some nodes (before ``args``)."""
    more = per_node or {}
    job = f"test-{uuid.uuid4().hex[:8]}"
    common = ["--nnodes", str(nnodes), "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    procs = [
        subprocess.Popen(
            _cmd(job, run_dir, [*common, "--node-rank", str(n), *more.get(n, []), *args]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(run_dir.parent),
        )
        for n in range(nnodes)
    ]
    return reap_agents(procs, job, timeout, [run_dir / "events.jsonl"])


def start_etcd_agents(
    url: str, run_dir: Path, args: list[str], *, nnodes: int = 2, nproc: int = 2
) -> list[subprocess.Popen[str]]:
    """One `stalwart run --rdzv URL` agent per node (node lease 2 s scaled for the load:
    tests/_load.py node_lease); ``args``: more flags, then the script and its arguments.
    The caller waits for and reaps them."""
    return [
        subprocess.Popen(
            [
                *_cmd_prefix(),
                "--rdzv",
                url,
                # a plain etcd: the token stays in a file of the job's (docs/security.md)
                "--token-file",
                str(run_dir.parent / "job-token"),
                "--run-dir",
                str(run_dir),
                "--nnodes",
                str(nnodes),
                "--node-rank",
                str(n),
                "--nproc-per-node",
                str(nproc),
                "--node-lease",
                node_lease(),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(run_dir.parent),
        )
        for n in range(nnodes)
    ]


def reap_agents(
    procs: list[subprocess.Popen[str]],
    job: str,
    timeout: float,
    progress: Sequence[Path] = (),
) -> list[tuple[int, str]]:
    """Wait for every agent (``timeout`` seconds each on a quiet machine, scaled for the
    load and extended while ``progress`` files or its output grow: tests/_load.py), stop
    any still running, check the job left no shared memory; returns each agent's (exit
    code, stderr)."""
    out = []
    try:
        for p in procs:
            _, err = wait_job(p, timeout, progress)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            _stop(p)
    _check_shm(job)
    return out


def _cmd_prefix() -> list[str]:
    return [sys.executable, "-m", "stalwart.cli.main", "run"]


def events_of(run_dir: Path) -> list[tuple[str, dict[str, object]]]:
    res = read_events(str(run_dir / "events.jsonl"))
    assert not res.problems, res.problems
    return [(e.kind, e.fields) for e in res.events]
