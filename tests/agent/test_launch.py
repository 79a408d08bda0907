"""A plain torchrun script (no stalwart import) runs unchanged under `stalwart run`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from stalwart.chaos import unmet_faults

from ._launch import events_of, stalwart_run

PLAIN = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_RESTART_COUNT"]
    words = ["ENV", *(os.environ[k] for k in keys), str(int(t[0])), *sys.argv[1:]]
    os.write(1, (" ".join(words) + "\\n").encode())
    if "--fail-first" in sys.argv and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        # rank 1 fails before any rank finished: rank 0 must not exit 0 first (a failure
        # after a peer finished ends the job instead: docs/recovery.md)
        if os.environ["RANK"] == "1":
            sys.exit(3)
        dist.barrier()  # rank 1 has left: this raises
        sys.exit(4)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(180)
def test_plain_script_and_max_restarts(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    ok = stalwart_run(tmp_path / "ok", ["--nproc-per-node", "2", str(script), "a", "--b"])
    assert ok.returncode == 0, ok.stderr
    lines = sorted(line for line in ok.stdout.splitlines() if line.startswith("ENV"))
    assert lines == ["ENV 0 0 2 2 0 0 3 a --b", "ENV 1 1 2 2 0 0 3 a --b"]
    token = tmp_path / "ok" / "token"
    assert token.stat().st_mode & 0o777 == 0o600

    # --max-restarts 1: rank 1 fails once, everyone is restarted, the run succeeds
    again = stalwart_run(
        tmp_path / "again",
        ["--nproc-per-node", "2", "--max-restarts", "1", str(script), "--fail-first"],
    )
    assert again.returncode == 0, again.stderr
    restarted = [line for line in again.stdout.splitlines() if line.startswith("ENV")]
    assert sorted(line.split()[6] for line in restarted) == ["0", "0", "1", "1"], again
    kinds = [k for k, _ in events_of(tmp_path / "again")]
    assert kinds.count("recovery_begin") == 1 and kinds[-1] == "run_end"

    # --max-restarts 0 (torchrun's default; stalwart's is 3): the failure ends the run
    fail = stalwart_run(
        tmp_path / "fail",
        ["--nproc-per-node", "2", "--max-restarts", "0", str(script), "--fail-first"],
    )
    assert fail.returncode == 1
    end = [f for k, f in events_of(tmp_path / "fail") if k == "run_end"]
    assert end and end[0]["status"] == "failed"


PLAIN_LOOP = textwrap.dedent(
    """
    import os
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the first attempt runs until the agent ends it; the restarted one finishes
    steps = 20 if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" else 100_000
    for _ in range(steps):
        loss = model(torch.ones(8, 4)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(180)
def test_plain_script_hang_is_detected_and_restarted(tmp_path: Path) -> None:
    """A plain script (no stalwart import) gets hang detection from its optimizer steps;
    torchrun would wait for its collective timeout (30 min by default)."""
    script = tmp_path / "loop.py"
    script.write_text(PLAIN_LOOP)
    run = stalwart_run(
        tmp_path / "hang",
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--chaos",
            "hang rank=1 at=step:200",  # its 200th optimizer.step(): a history to judge by
            str(script),
        ],
        timeout=150,
    )
    assert run.returncode == 0, run.stderr
    events = events_of(tmp_path / "hang")
    assert not unmet_faults(events), unmet_faults(events)  # "... never fired: <why>"
    hangs = [f for k, f in events if k == "fault_detected" and f["fault"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["domain"]["rank"] == 1, events
    assert "stopped" in hangs[0]["how"]
    begins = [f for k, f in events if k == "recovery_begin"]
    assert [b["strategy"] for b in begins] == ["restart"]
    end = [f for k, f in events if k == "run_end"]
    assert end and end[0]["status"] == "ok"


def test_bad_chaos_spec_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    bad = stalwart_run(tmp_path / "bad", ["--chaos", "kill rank=1 at=stp:3", str(script)])
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "'at=stp:3'" in bad.stderr
