from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from stalwart.metrics import EventLog, EventLogError, read_events


def test_emit_and_read_back(tmp_path: Path) -> None:
    path = str(tmp_path / "run" / "events.jsonl")
    with EventLog(path, node=1, rank=None) as log:
        log.emit("run_start", job="j", world_size=4, nnodes=2, strategy="flash", config={})
        log.emit(
            "fault_detected", fault="crash", domain={"rank": 2, "node": 1}, latency_s=0.01, rank=2
        )
    res = read_events(path)
    assert not res.partial and res.problems == []
    assert [e.kind for e in res.events] == ["run_start", "fault_detected"]
    assert res.events[1].rank == 2 and res.events[1].node == 1
    assert res.events[1]["domain"] == {"rank": 2, "node": 1}


@pytest.mark.parametrize(
    ("kind", "fields", "msg"),
    [
        ("nope", {}, "unknown event kind"),
        ("snapshot", {"step": 1}, "lacks required field"),
        ("snapshot", {"step": 1, "stall_s": 0.1, "oops": 1}, "has no field 'oops'"),
        ("snapshot", {"step": "1", "stall_s": 0.1}, "expected int"),
        ("snapshot", {"step": True, "stall_s": 0.1}, "expected int"),
    ],
)
def test_schema_is_enforced(tmp_path: Path, kind: str, fields: dict[str, object], msg: str) -> None:
    with EventLog(str(tmp_path / "e.jsonl")) as log, pytest.raises(EventLogError, match=msg):
        log.emit(kind, **fields)


def test_truncated_tail_is_partial(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(str(path)) as log:
        log.emit("note", message="a")
    with open(path, "ab") as f:
        f.write(b'{"v":1,"t":1.0,"kind":"no')
    res = read_events(str(path))
    assert res.partial and len(res.events) == 1 and res.problems


def test_missing_log_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EventLogError, match="no event log here"):
        read_events(str(tmp_path / "events.jsonl"))


def _writer(path: str, n: int) -> None:
    with EventLog(path) as log:
        for i in range(n):
            log.emit("note", message=f"{i:04d}" + "x" * 200)


def test_processes_append_without_interleaving(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    procs = [mp.get_context("fork").Process(target=_writer, args=(path, 300)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    res = read_events(path)
    assert len(res.events) == 900 and not res.problems
