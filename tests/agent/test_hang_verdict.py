"""Hang detection that cannot kill a busy rank, and verdicts instead of crash loops
(multi-process; the logic itself is tested in-process in detection/test_hang.py and
detection/test_verdict.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ._launch import events_of, stalwart_run

RUNTIME = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import stalwart

    mode = sys.argv[1]
    sess = stalwart.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sess.track(model=model, optimizer=opt)
    launch_rank = int(os.environ["RANK"])

    def busy(seconds):
        a = torch.randn(128, 128)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            a = torch.tanh(a @ a)

    for step in sess.steps(10):
        if step in (3, 7) and sess.rank == 0:
            if mode == "busy":
                busy(3.0)  # an eval that computes, not declared
            elif mode == "pause":
                with sess.pause("eval"):
                    time.sleep(3.0)  # declared, and idle (e.g. waiting for an eval server)
            elif mode == "sleep":
                # idle, not declared: long enough that a loaded machine's detector
                # still sees it (it is killed within seconds of --hang-idle 1)
                time.sleep(30.0)
        if mode == "bug" and launch_rank == 1 and step == 6:
            raise ValueError(f"bad batch at step {step}")
        loss = model(torch.ones(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sess.close()
    """
)

PLAIN = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 11):
        if step in (3, 7) and dist.get_rank() == 0:  # rank 0 evaluates, rank 1 waits
            a = torch.randn(128, 128)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                a = torch.tanh(a @ a)
        loss = model(torch.ones(4, 8)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    """
)


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


def _hangs(run_dir: Path) -> list[dict[str, object]]:
    events = events_of(run_dir)
    return [f for k, f in events if k == "fault_detected"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "kind",
    [
        "runtime",
        "plain",
    ],
)
def test_a_long_busy_eval_on_rank_0_is_never_killed(tmp_path: Path, kind: str) -> None:
    """nanoGPT's rank-0 eval: 3 s of compute between steps (3 x p99 is milliseconds)
    while rank 1 waits in its allreduce: neither is a hang."""
    script = _script(tmp_path, RUNTIME if kind == "runtime" else PLAIN)
    run = stalwart_run(
        tmp_path / "run", ["--nproc-per-node", "2", str(script), "busy"], timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert _hangs(tmp_path / "run") == []
    end = [f for k, f in events_of(tmp_path / "run") if k == "run_end"]
    assert end and end[0]["status"] == "ok"


@pytest.mark.timeout(200)
def test_pause_declares_idle_work_and_undeclared_idling_is_stuck(tmp_path: Path) -> None:
    """With --hang-idle 1, rank 0 sleeping 3 s inside sess.pause is fine; an
    undeclared sleep outside it is a stuck rank, and (with --crash-loop-limit 1) a verdict."""
    script = _script(tmp_path, RUNTIME)
    flags = ["--nproc-per-node", "2", "--hang-idle", "1", "--crash-loop-limit", "1"]
    ok = stalwart_run(tmp_path / "pause", [*flags, str(script), "pause"], timeout=120)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert _hangs(tmp_path / "pause") == []

    stuck = stalwart_run(tmp_path / "sleep", [*flags, str(script), "sleep"], timeout=120)
    assert stuck.returncode == 1, stuck.stderr[-3000:]
    hangs = _hangs(tmp_path / "sleep")
    assert [(h["fault"], h["domain"]["rank"]) for h in hangs] == [("hang", 0)]  # type: ignore[index]
    assert "no CPU progress outside a collective" in str(hangs[0]["how"])
    verdicts = [ln for ln in stuck.stderr.splitlines() if "hung 1 times in a row" in ln]
    assert len(verdicts) == 1, stuck.stderr[-3000:]
    assert "rank 0 hung 1 times in a row at step 3" in verdicts[0], stuck.stderr[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["flash", "restart", "elastic"])
def test_a_deterministic_bug_ends_the_job_with_a_verdict(tmp_path: Path, strategy: str) -> None:
    """Rank 1 raises at step 6 in every incarnation: the third time, the job ends with
    one line naming the rank, the step, the error and what to do."""
    script = _script(tmp_path, RUNTIME)
    run = stalwart_run(
        tmp_path / "run",
        ["--nproc-per-node", "2", "--strategy", strategy, str(script), "bug"],
        timeout=120,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    verdict = [line for line in run.stderr.splitlines() if "3 times in a row" in line]
    assert len(verdict) == 1, run.stderr[-3000:]
    assert "rank 1 failed 3 times in a row at step 6" in verdict[0]
    assert "ValueError: bad batch at step 6" in verdict[0]
    end = [f for k, f in events_of(tmp_path / "run") if k == "run_end"]
    assert end and end[0]["status"] == "failed"
    assert "ValueError: bad batch at step 6" in str(end[0]["reason"])
