"""agent/_lifecycle.sweep_shm: an agent's start claims its run's /dev/shm names and says
in one line, with an event, what it removed of this user's dead runs (in-process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from stalwart.agent._lifecycle import sweep_shm
from stalwart.agent._types import NodeContext
from stalwart.agent.config import LaunchConfig
from stalwart.chaos import FaultLedger
from stalwart.checkpoint.slots import run_owner
from stalwart.contract.shm_names import SlotNames, new_run_id
from stalwart.metrics.events import EventLog


def _ctx(tmp: Path, said: list[str]) -> NodeContext:
    run_dir = tmp / "run"
    run_dir.mkdir()
    cfg = LaunchConfig(script=__file__, job="sweep")
    events = EventLog(str(run_dir / "events.jsonl"), node=0)
    return NodeContext(cfg, str(run_dir), events, FaultLedger(str(run_dir)), said.append)


def _dead_run(shm: Path) -> SlotNames:
    dead = SlotNames("dead", new_run_id(), str(shm))
    os.makedirs(dead.rank_dir(0), mode=0o700)
    Path(dead.rank_dir(0), "slot-0").write_bytes(b"x" * 64)
    run_owner(dead).write()
    path = run_owner(dead).path
    doc = json.loads(Path(path).read_text())
    doc["start"] = int(doc["start"]) + 12345  # this pid, another start: a process that is gone
    Path(path).write_text(json.dumps(doc))
    return dead


def test_the_start_says_what_it_removed_of_dead_runs(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = _dead_run(shm)
    said: list[str] = []
    ctx = _ctx(tmp_path, said)
    mine = SlotNames("mine", new_run_id(), str(shm))
    sweep_shm(mine, ctx)
    assert not os.path.exists(dead.rank_dir(0))
    assert os.path.exists(run_owner(mine).path)  # this run's claim stays
    assert len(said) == 1 and "removed 2 /dev/shm entries of dead runs" in said[0], said
    lines = Path(ctx.run_dir, "events.jsonl").read_text().splitlines()
    notes = [e for e in map(json.loads, lines) if e.get("kind") == "note"]
    assert any("dead runs" in n.get("message", "") for n in notes), notes


def test_the_start_says_nothing_when_nothing_was_left(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    said: list[str] = []
    sweep_shm(SlotNames("mine", new_run_id(), str(shm)), _ctx(tmp_path, said))
    assert said == []
