"""A straggler under `stalwart run`, end to end (one multi-process test): rank 1 slowed
4x (chaos ``slow``) is declared from the compute times its runtime publishes, evicted
(``--on-straggler evict``) and replaced in place (flash) while rank 0 keeps its process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stalwart.metrics.events import read_events

from ._launch import start_run, stop_run

SCRIPT = """
import time
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import stalwart

torch.set_num_threads(1)
model = torch.nn.Linear(16, 1)
sess = stalwart.init()
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
sess.track(model=ddp, optimizer=opt)
x = torch.ones(8, 16)
for step in sess.steps(1_000_000):  # ended by the test (SIGTERM)
    end = time.perf_counter() + 0.02  # 20 ms of compute
    while time.perf_counter() < end:
        pass
    opt.zero_grad()
    ddp(x).sum().backward()
    opt.step()
"""


def _kinds(run_dir: Path) -> list[tuple[str, dict[str, object]]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [(e.kind, e.fields) for e in read_events(str(path)).events]  # partial tail: fine


@pytest.mark.timeout(240)
def test_a_slowed_rank_is_declared_evicted_and_replaced(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    args = ["--nproc-per-node", "2", "--on-straggler", "evict",
            "--chaos", "slow rank=1 factor=4 at=step:40", str(script)]  # fmt: skip
    job, proc = start_run(run_dir, args)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None:
            kinds = [k for k, _ in _kinds(run_dir)]
            if "straggler" in kinds and "recovery_end" in kinds[kinds.index("straggler") :]:
                break
            time.sleep(0.5)
    finally:
        stop_run(job, proc)
    events = _kinds(run_dir)
    stragglers = [f for k, f in events if k == "straggler"]
    assert len(stragglers) == 1, (events, proc.stderr.read() if proc.stderr else "")
    assert stragglers[0]["domain"] == {"rank": 1, "node": 0}
    assert stragglers[0]["action"] == "evict" and float(stragglers[0]["ratio"]) > 1.35
    detected = [f["fault"] for k, f in events if k == "fault_detected"]
    assert detected == ["straggler"]  # the eviction is not reported again as a crash
    leaves = [f for k, f in events if k == "member_leave"]
    assert [(f["member"], f["reason"]) for f in leaves][:1] == [("rank1", "straggler")]
    assert any(k == "recovery_end" for k, _ in events)
    assert not [p for p in os.listdir("/dev/shm") if job in p]
