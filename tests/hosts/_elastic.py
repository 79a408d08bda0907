"""The elastic job of the partition cells (test_partition_matrix.py, bench/partition.py):
examples/train_elastic.py with its per-rank trace, and what its outcome must be against a
fault-free fixed-size run: each step's committed samples and mean loss the same (a
constant global batch), no step traced in a generation the job had left."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ._job import HostJob, bumps
from ._lab import Lab

__all__ = [
    "ARGS",
    "EXAMPLE",
    "FAULT_AT",
    "FLAGS",
    "LOSS_RTOL",
    "STEPS",
    "Trace",
    "committed",
    "compare",
    "fault_free_trace",
    "generations",
    "job_of",
    "newest_step",
    "old_generation_records",
    "trace",
    "wait_traced",
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"
STEPS = 300
FAULT_AT = 40
ARGS = ["--steps", str(STEPS), "--step-sleep", "0.05"]
FLAGS = ["--strategy", "elastic", "--nnodes", "1:2"]
Trace = dict[int, list[dict[str, Any]]]
LOSS_RTOL = 1e-2
"""How far a step's mean loss may be from the reference run's. Not bit-identical: the
same world of 4 summed across two hosts and on one host diverged from step 31 on,
fault-free (2e-5 relative by step 40, 3e-3 by step 300); the samples must be the same."""


def trace(job: HostJob) -> list[dict[str, Any]]:
    """Every rank's trace records (the script's ``--trace`` under the job's work dir)."""
    recs = []
    for path in sorted((job.work / "trace").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return recs


def newest_step(job: HostJob) -> int:
    return max((int(r["step"]) for r in trace(job)), default=0)


def wait_traced(job: HostJob, step: int, timeout: float) -> None:
    """Until some rank traced ``step`` (a job that ended first, or the deadline: fail)."""
    deadline = time.monotonic() + timeout
    while newest_step(job) < step:
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            raise AssertionError(f"no step {step} traced; the agents: {job.stop()}")
        time.sleep(0.2)


def committed(recs: list[dict[str, Any]]) -> Trace:
    """step -> the records of its committed attempt (the newest generation that ran it)."""
    last: dict[int, int] = {}
    for r in recs:
        last[r["step"]] = max(last.get(r["step"], -1), r["gen"])
    out: Trace = {}
    for r in recs:
        if r["gen"] == last[r["step"]]:
            out.setdefault(r["step"], []).append(r)
    return out


def job_of(lab: Lab, work: Path, hosts: list[int], **kw: Any) -> HostJob:
    """The elastic job (not started) on ``hosts``; ``kw``: more :class:`HostJob` fields."""
    tail = ["--trace", str(work / "trace")]
    return HostJob(lab, work, hosts, ARGS, script=EXAMPLE, tail=tail, **kw)


def fault_free_trace(work: Path) -> Trace:
    """The committed trace of a fault-free fixed-size run (one host, 4 workers)."""
    with Lab(1) as lab:
        job = job_of(lab, work, [0], nproc=4)
        try:
            job.start()
            ended = job.wait(300)
        finally:
            job.stop()
    assert [rc for rc, _ in ended] == [0], ended
    return committed(trace(job))


def compare(got: Trace, reference: Trace) -> str | None:
    """Why ``got`` is not the reference run's (None: every step committed, with the same
    samples, and a mean loss within ``LOSS_RTOL``)."""
    if sorted(got) != sorted(reference):
        missing = sorted(set(reference) - set(got))
        return f"steps missing: {missing[:5]} ({len(missing)})"
    for step, rs in got.items():
        world = int(rs[0]["world"])
        if len(rs) != world:
            return f"step {step}: {len(rs)} records for {world} ranks"
        mine = sorted(i for r in rs for i in r["samples"])
        if mine != sorted(i for r in reference[step] for i in r["samples"]):
            return f"step {step} read other samples"
        loss = sum(float(r["loss"]) for r in rs) / world
        ref = sum(float(r["loss"]) for r in reference[step]) / len(reference[step])
        if abs(loss - ref) > LOSS_RTOL * abs(ref):
            return f"step {step}: mean loss {loss} against {ref}"
    return None


def generations(run_dir: Path) -> dict[int, float]:
    """generation -> when it was first recorded: ``generation`` events and, since an
    elastic resize moves the generation without one, ``resize`` and ``recovery_begin``."""
    first = bumps(run_dir)
    for path in sorted(run_dir.rglob("events*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if doc.get("kind") in ("resize", "recovery_begin") and "generation" in doc:
                gen, t = int(doc["generation"]), float(doc["t"])
                first[gen] = min(t, first.get(gen, t))
    return first


def old_generation_records(recs: list[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """Steps traced in a generation after a later one was recorded, past the one step
    per process that may have been in flight at the bump (a split brain)."""
    first = generations(run_dir)
    late: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(recs, key=lambda r: float(r["t"])):
        newer = [when for g, when in first.items() if g > r["gen"]]
        if newer and float(r["t"]) > min(newer):
            late.setdefault(int(r["pid"]), []).append(r)
    return [r for rs in late.values() for r in rs[1:]]
