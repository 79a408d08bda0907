"""Launch a corpus script and read back what it recorded (examples/corpus/_record.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from _load import Deadline, scaled, wait_job
from _terminal import ctrl_c_as_in_a_terminal
from agent._launch import events_of, stalwart_run

__all__ = ["CORPUS", "Outcome", "interrupt_run", "read_outcome", "run_script", "torchrun"]

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "corpus"


@dataclass
class Outcome:
    """One run: its exit, stderr, events, the digests per member and the committed trace."""

    rc: int
    stderr: str
    events: list[tuple[str, dict[str, object]]]
    finals: dict[int, str]  # member -> sha256 of its final parameters
    trace: dict[int, list[dict[str, object]]] = field(default_factory=dict)
    """step -> the records of its committed attempt, one per rank that took part"""
    summaries: dict[int, dict[str, float]] = field(default_factory=dict)
    """member -> what the framework reported after training (``summary`` of its final)"""
    files: Path | None = None  # the script's --out folder

    def kinds(self, kind: str) -> list[dict[str, object]]:
        return [f for k, f in self.events if k == kind]

    def losses(self) -> dict[tuple[int, int], float]:
        """(step, member) -> that rank's loss in the step's committed attempt."""
        return {
            (step, int(str(r["member"]))): float(str(r["loss"]))
            for step, recs in self.trace.items()
            for r in recs
        }


def _committed(out: Path) -> dict[int, list[dict[str, object]]]:
    """A member's later record of a step supersedes its earlier one (a replay after a
    rollback or a restart); across members, only the latest attempt of the step counts
    (under elastic a member that left may have recorded a step the job then redid)."""
    per_member: dict[int, dict[int, dict[str, object]]] = {}
    for f in sorted(out.glob("trace-m*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the last line of a process killed mid-write
                continue
            per_member.setdefault(int(rec["member"]), {})[int(rec["step"])] = rec
    steps: dict[int, list[dict[str, object]]] = {}
    for recs in per_member.values():
        for step, rec in recs.items():
            steps.setdefault(step, []).append(rec)
    out_steps = {}
    for step, recs in steps.items():
        latest = max(tuple(r["attempt"]) for r in recs)  # type: ignore[arg-type]
        out_steps[step] = [r for r in recs if tuple(r["attempt"]) == latest]  # type: ignore[arg-type]
    return dict(sorted(out_steps.items()))


def read_outcome(rc: int, stderr: str, run_dir: Path | None, out: Path) -> Outcome:
    finals, summaries = {}, {}
    for f in out.glob("final-m*.json"):
        rec = json.loads(f.read_text())
        finals[int(rec["member"])] = str(rec["digest"])
        if isinstance(rec.get("summary"), dict):
            summaries[int(rec["member"])] = rec["summary"]
    events = (
        events_of(run_dir) if run_dir is not None and (run_dir / "events.jsonl").exists() else []
    )
    trace = _committed(out) if out.exists() else {}
    return Outcome(rc, stderr, events, finals, trace, summaries, out)


def run_script(
    run_dir: Path, script: str, flags: list[str], args: list[str], *, timeout: float
) -> Outcome:
    """`stalwart run FLAGS examples/corpus/SCRIPT ARGS --out RUN_DIR/corpus`."""
    out = run_dir / "corpus"
    cmd = [*flags, str(CORPUS / script), *args, "--out", str(out)]
    proc = stalwart_run(run_dir, cmd, timeout=timeout)
    return read_outcome(proc.returncode, proc.stderr, run_dir, out)


def torchrun(out_parent: Path, script: str, args: list[str], *, nproc: int) -> Outcome:
    """The same script under torchrun itself: the behaviour a plain script must keep. It
    runs in ``out_parent``: a script's own files (ddp_tutorial.py's snapshot, relative to
    the working directory) are its run's alone, so a reference run again after torch's
    exit abort does not resume from the files of the attempt before it."""
    out = out_parent / "corpus"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), str(CORPUS / script), *args, "--out", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out_parent
    )
    _, err = wait_job(proc, 120, [out])
    return read_outcome(proc.returncode, err, None, out)


def _shm_of(job: str) -> list[str]:
    return [p for p in os.listdir("/dev/shm") if job in p]


def interrupt_run(
    run_dir: Path, script: str, flags: list[str], args: list[str], *, after_step: int
) -> tuple[Outcome, list[str]]:
    """Start `stalwart run` in its own process group, wait until member 0 recorded
    ``after_step``, then SIGINT the whole group (what a terminal's Ctrl-C does). Returns
    the outcome and the /dev/shm entries the job left (removed here afterwards)."""
    job = f"test-{uuid.uuid4().hex[:8]}"
    out = run_dir / "corpus"
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--rdzv-id", job]
    cmd += ["--run-dir", str(run_dir), *flags, str(CORPUS / script), *args, "--out", str(out)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(run_dir.parent),
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    trace = out / "trace-m0.jsonl"
    deadline = Deadline(90)
    try:
        while not deadline.expired() and proc.poll() is None:
            lines = trace.read_text().splitlines() if trace.exists() else []
            if any(f'"step": {after_step},' in line for line in lines):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        stop_s = scaled(30)
        try:
            _, err = proc.communicate(timeout=stop_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"Ctrl-C did not end the run within {stop_s:.0f} s") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        left = _shm_of(job)
        for name in left:
            path = Path("/dev/shm") / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return read_outcome(proc.returncode, err, run_dir, out), left
