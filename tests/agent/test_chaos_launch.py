"""Chaos under a real `stalwart run`: step faults on a plain script, unfired faults."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from stalwart.chaos import unmet_faults

from ._launch import events_of, stalwart_run

# a plain DDP-style loop: no stalwart import; the restarted attempt runs the same 12 steps
PLAIN_STEPS = textwrap.dedent(
    """
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(12):
        model(torch.ones(8, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(200)
def test_step_fault_fires_on_a_plain_script_and_unfired_faults_are_warned(
    tmp_path: Path,
) -> None:
    """`kill rank=1 at=step:5` on a plain script fires before its 5th optimizer.step()
    (once: the restarted attempt steps past 5 again); `at=time:1h` and `at=step:500` never
    come, and the end of the run says so, one line each."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_STEPS)
    spec = "kill rank=1 at=step:5; hang rank=0 at=time:1h; kill rank=0 at=step:500"
    run = stalwart_run(
        tmp_path / "run",
        ["--nproc-per-node", "2", "--max-restarts", "1", "--chaos", spec, str(script)],
        timeout=170,
    )
    assert run.returncode == 0, run.stderr
    events = events_of(tmp_path / "run")
    injected = [f for k, f in events if k == "fault_injected"]
    assert [(f["fault"], f["domain"]["rank"]) for f in injected] == [("kill", 1)], events
    assert [f["strategy"] for k, f in events if k == "recovery_begin"] == ["restart"]
    unmet = unmet_faults(events)  # the check a faulted test runs, here on what must not fire
    assert len(unmet) == 2, unmet
    assert "'hang rank=0 at=time:1h' never fired: the job ended first" in unmet[0]
    assert "'kill rank=0 at=step:500' never fired: the job ended at step 12 before" in unmet[1]
    warned = [line for line in run.stderr.splitlines() if "never fired" in line]
    assert len(warned) == 2, run.stderr
    kinds = [k for k, _ in events]
    assert kinds.index("run_end") > max(i for i, k in enumerate(kinds) if k == "fault_unfired")
