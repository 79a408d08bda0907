"""`stalwart chaos RUN_DIR ...`: faults checked against the run's job before queueing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.chaos import ChaosSpecError
from stalwart.cli.chaos import queue_faults
from stalwart.metrics import EventLog


def test_faults_outside_the_run_are_refused_the_rest_queued(tmp_path: Path) -> None:
    with EventLog(str(tmp_path / "events.jsonl"), node=0) as log:
        log.emit("run_start", job="j", world_size=2, nnodes=1, strategy="flash")
    with pytest.raises(ChaosSpecError, match="rank 5 is outside the job"):
        queue_faults(str(tmp_path), "kill rank=5")
    with pytest.raises(ChaosSpecError, match="node 1 is outside the job"):
        queue_faults(str(tmp_path), "hang node=1 at=step:3")
    assert not (tmp_path / "chaos").exists()
    assert queue_faults(str(tmp_path), "kill rank=1") == "kill rank=1 at=time:0s"
    (request,) = (tmp_path / "chaos" / "requests").iterdir()
    assert json.loads(request.read_text()) == {"spec": "kill rank=1 at=time:0s"}
