"""Workers end like `python script.py`, with torchrun's environment; Ctrl-C and SIGTERM
end a run cleanly in any state (multi-process: few, bounded, every process reaped)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from _load import scaled
from _terminal import ctrl_c_as_in_a_terminal

from stalwart.metrics.report import load_run

from ._launch import events_of, stalwart_run

ENDING = textwrap.dedent(
    """
    import atexit, os, sys, time
    from torch.distributed.elastic.multiprocessing.errors import record

    out, rank = sys.argv[1], os.environ["RANK"]

    def bye():
        with open(os.path.join(out, "atexit" + rank), "w") as f:
            f.write("ok")

    atexit.register(bye)
    # stdout is a pipe here: block-buffered, lost unless flushed at the exit
    # one write per line: the ranks share the pipe (print's pieces would interleave)
    sys.stdout.write(" ".join(["ENV", rank, __file__, os.environ["MASTER_ADDR"],
                               os.environ.get("TORCHELASTIC_ERROR_FILE", "-")]) + "\\n")

    @record
    def main():
        if rank == "1":
            deadline = time.time() + 60  # rank 0 first ends cleanly
            while not os.path.exists(os.path.join(out, "atexit0")) and time.time() < deadline:
                time.sleep(0.05)
            raise ValueError("boom-1234")

    main()
    """
)


@pytest.mark.timeout(150)
def test_worker_exit_runs_atexit_flushes_and_reports_the_error_file(tmp_path: Path) -> None:
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    out = tmp_path / "out"
    out.mkdir()
    run = stalwart_run(
        tmp_path / "run",
        # one launch: the run's restart budget would run the failing script again
        ["--nproc-per-node", "2", "--max-restarts", "0", "ending.py", str(out)],
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert (out / "atexit0").read_text() == "ok" and (out / "atexit1").read_text() == "ok"
    envs = sorted(line.split() for line in run.stdout.splitlines() if line.startswith("ENV"))
    assert [e[1] for e in envs] == ["0", "1"], run.stdout
    for _, rank, file, addr, err in envs:
        assert file == str(script)  # absolute, as `python ending.py` gives
        assert addr == socket.getfqdn()  # what torchrun sets
        assert err.startswith(str(tmp_path / "run" / "errors" / f"rank{rank}."))
    crash = [line for line in run.stderr.splitlines() if "rank 1 crashed" in line]
    assert crash and "ValueError: boom-1234" in crash[0], run.stderr


ENDLESS = textwrap.dedent(
    """
    import time, torch, stalwart
    from torch.nn.parallel import DistributedDataParallel as DDP

    sess = stalwart.init()
    model = DDP(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sess.track(model=model, optimizer=opt)
    for step in sess.steps(1_000_000):
        loss = model(torch.ones(2, 4)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sess.log(loss=loss)
        time.sleep(0.005)
    """
)

CRASH_LOOP = textwrap.dedent(
    """
    import os, sys, time, torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    fail_at = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + 2  # never the same step
    for step in range(1, 100_000):
        opt.zero_grad()
        m(torch.ones(1, 2)).sum().backward()
        opt.step()
        if dist.get_rank() == 1 and step == fail_at:
            sys.exit(1)
        time.sleep(0.02)
    """
)


def _launch(tmp_path: Path, job: str, args: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "stalwart.cli.main", "run", "--rdzv-id", job]
    return subprocess.Popen(
        [*cmd, "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", *args],
        cwd=str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job
        preexec_fn=ctrl_c_as_in_a_terminal,
    )


def _wait_for(run_dir: Path, kind: str, proc: subprocess.Popen[str], timeout: float) -> None:
    path = run_dir / "events.jsonl"
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and f'"kind":"{kind}"' in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {kind!r} event within {scaled(timeout):.0f}s (rc {proc.poll()})")


# How long an agent's teardown may take once its signal arrived: the sum of the bounds
# of its steps (agent/agent.py's ExitStack): stop the workers (5 s), join the probe thread
# (5 s), wait for the other agents' goodbyes (10 s), close the zygote (5 s), and the store
# calls on the way (each retried for up to 30 s), doubled for a machine at load ~20.
TEARDOWN_S = 2 * (5 + 5 + 10 + 5 + 30)


def _ended(proc: subprocess.Popen[str], job: str) -> tuple[int, str]:
    """Wait for the agent to exit (within TEARDOWN_S of its signal), then for every
    process of the job to be gone (the end of its stderr: the zygote, its store host and
    the workers all hold it; each dies with its parent, agent/processes/_zygote.py); either wait
    that runs out names what was still alive."""
    try:
        proc.wait(timeout=TEARDOWN_S)
    except subprocess.TimeoutExpired:
        alive = _session(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"the agent did not end within {TEARDOWN_S} s of its signal; "
                             f"alive: {alive}\n{err[-3000:]}") from None  # fmt: skip
    try:
        _, err = proc.communicate(timeout=TEARDOWN_S)
    except subprocess.TimeoutExpired:
        alive = _session(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"the agent exited but its processes did not: {alive}") from None
    left = [p for p in os.listdir("/dev/shm") if job in p]
    assert not left, f"shared memory left behind: {left}"
    return proc.returncode, err


def _session(sid: int) -> list[str]:
    """The processes of session ``sid`` (the launch's): pid, state, command."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if int(fields[3]) == sid:  # the session id, after state, ppid and pgrp
            out.append(f"{pid} {fields[0]} {cmd}")
    return out


@pytest.mark.timeout(600)
def test_ctrl_c_and_sigterm_in_a_crash_loop_end_cleanly(tmp_path: Path) -> None:
    # Ctrl-C: SIGINT to the whole process group (agent, zygote, store host, workers)
    a = tmp_path / "a"
    a.mkdir()
    (a / "endless.py").write_text(ENDLESS)
    job = f"test-{uuid.uuid4().hex[:8]}"
    proc = _launch(a, job, ["endless.py"])
    _wait_for(a / "run", "loss", proc, 90)  # sess.log(loss=...) is an event
    _wait_for(a / "run", "steps", proc, 30)
    os.killpg(proc.pid, signal.SIGINT)
    rc, err = _ended(proc, job)
    assert rc == 130, err
    end = [f for k, f in events_of(a / "run") if k == "run_end"]
    assert end and end[0]["status"] == "interrupted", err
    d = load_run(str(a / "run")).to_dict()
    assert not d["partial"] and d["series"]["loss"] and d["steps"]["productive"] > 0

    # SIGTERM to the launcher while it restarts a crashing plain script again and again
    b = tmp_path / "b"
    b.mkdir()
    (b / "loop.py").write_text(CRASH_LOOP)
    job = f"test-{uuid.uuid4().hex[:8]}"
    proc = _launch(b, job, ["--strategy", "restart", "--max-restarts", "100", "loop.py"])
    _wait_for(b / "run", "recovery_begin", proc, 90)
    os.kill(proc.pid, signal.SIGTERM)
    rc, err = _ended(proc, job)
    assert rc == 143, err
    events = events_of(b / "run")
    end = [f for k, f in events if k == "run_end"]
    assert end and end[0]["status"] == "terminated", err
    assert [f["route"] for k, f in events if k == "route"] == ["plain"]
    assert any(k == "steps" for k, _ in events)  # the plain script's steps, recorded
