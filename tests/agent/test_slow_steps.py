"""A plain script of slow steps (2-3 s each, a slower first one) under `stalwart run`
with the default bounds: never taken for hung, and a real hang in it (SIGSTOP) is found
after the floor, not after 3 x its p99 step time (issue 28; agent/detection/hang.py)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from stalwart.chaos import unmet_faults

from ._launch import events_of, stalwart_run

SLOW = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    again = os.environ["TORCHELASTIC_RESTART_COUNT"] != "0"
    steps = 2 if again else 6
    for i in range(steps):
        # a slow step that mostly waits (a device sync, a far data store); the first is
        # slower still (a compile)
        time.sleep(4.0 if i == 0 else 2.5)
        loss = model(torch.ones(8, 4)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        # one write per line: the ranks share the agent's pipe (print's pieces interleave)
        os.write(1, f"STEP {dist.get_rank()} {i}\\n".encode())
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(300)
def test_slow_steps_are_not_a_hang_and_a_stop_among_them_is_found_after_the_floor(
    tmp_path: Path,
) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW)
    run = stalwart_run(
        tmp_path / "slow",
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--chaos",
            "hang rank=1 at=step:4",  # after 3 slow steps: a p99 of ~2.5 s to judge by
            str(script),
        ],
        timeout=200,
    )
    assert run.returncode == 0, run.stderr
    events = events_of(tmp_path / "slow")
    assert not unmet_faults(events), unmet_faults(events)
    # the slow steps before it were never taken for a hang: the one hang is the stop
    hangs = [f for k, f in events if k == "fault_detected" and f["fault"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["domain"]["rank"] == 1, hangs
    assert "stopped" in hangs[0]["how"]
    bound = re.search(r"threshold ([0-9.]+)s", hangs[0]["how"])
    assert bound is not None and float(bound.group(1)) == 1.0, hangs[0]["how"]  # the floor
    steps = [line for line in run.stdout.splitlines() if line.startswith("STEP ")]
    assert {"STEP 0 2", "STEP 1 2"} <= set(steps), run.stdout  # 3 slow steps before it
    end = [f for k, f in events if k == "run_end"]
    assert end and end[0]["status"] == "ok"
