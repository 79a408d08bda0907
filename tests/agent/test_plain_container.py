"""A plain torchtitan-style script under a real `stalwart run`: an optimizer container
(its step() steps one AdamW per model part) is one step per iteration, `at=step:N` fires
before its Nth step, and after the kill the script resumes from its own checkpoint: the
report counts the steps it redid from there, and the restart's RTO."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from stalwart.metrics.report import load_run

from ._launch import events_of, stalwart_run

_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {models!r})
    from _titan import make_titan, titan_step

    ckpt = os.path.join(os.path.dirname(os.path.abspath(__file__)), "own.pt")
    state, start = make_titan(), 0
    if os.path.exists(ckpt):  # the script's own resume, as torchtitan's trainer does
        saved = torch.load(ckpt)
        state["model"].load_state_dict(saved["model"])
        state["optimizer"].load_state_dict(saved["optimizer"])  # DCP: a lazy-init step
        start = saved["step"]
    for step in range(start + 1, 13):
        titan_step(state)
        time.sleep(0.1)  # a step's compute: the agent reads the board between steps
        if step == 4:
            sd = {{k: state[k].state_dict() for k in ("model", "optimizer")}}
            torch.save({{**sd, "step": step}}, ckpt)
    """
)


@pytest.mark.timeout(200)
def test_a_plain_container_script_counts_each_step_once_and_its_resume(tmp_path: Path) -> None:
    models = str(Path(__file__).resolve().parents[1] / "checkpoint")
    script = tmp_path / "titan_plain.py"
    script.write_text(_SCRIPT.format(models=models))
    run = stalwart_run(
        tmp_path / "run",
        [
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
            "--chaos",
            "kill rank=0 at=step:6",
            str(script),
        ],
        timeout=170,
    )
    assert run.returncode == 0, run.stderr
    events = events_of(tmp_path / "run")
    steps = [f for k, f in events if k == "steps"]
    first = [f for f in steps if f["generation"] == 0]
    assert max(f["last_step"] for f in first) == 5  # killed before its 6th step, not its 3rd
    end = next(f for k, f in events if k == "recovery_end")
    assert (end["restored_step"], end["steps_lost"]) == (4, 1)  # its checkpoint of step 4
    assert max(f["last_step"] for f in steps) == 12  # 12 steps, not 36
    report = load_run(str(tmp_path / "run")).to_dict()
    assert report["steps"]["lost"] == 1 and report["steps"]["productive"] == 12
    assert report["rto_s"]["p50"] is not None
