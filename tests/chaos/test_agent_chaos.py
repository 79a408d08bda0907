"""The agent's side of chaos, in-process: request files, the `time:` origin, unfired faults."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.agent.processes._chaos import AgentChaos
from stalwart.agent.processes._workers import Worker, WorkerState
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.contract.board import ProgressBoard, Slot


class _Events:
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.unfired: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        if kind == "note":
            self.notes.append(str(fields["message"]))
        elif kind == "fault_unfired":
            self.unfired.append(fields)


class _Workers:
    """What AgentChaos uses of LocalWorkers: one running rank-0 worker on ``board``."""

    def __init__(self, board: ProgressBoard | None) -> None:
        self.board = board
        w = Worker(0, 0, 0, pid=os.getpid(), state=WorkerState.RUNNING, attached=True)
        self.workers = {0: w}

    def __iter__(self) -> Any:
        return iter(self.workers.values())

    def get(self, rank: int) -> Worker | None:
        return self.workers.get(rank)

    def slot(self, w: Worker) -> Slot:
        assert self.board is not None
        return self.board.read(w.slot)

    def ranks(self) -> list[int]:
        return list(self.workers)

    def last_step(self) -> int:
        return 12


def _agent(tmp_path: Path, spec: str | None = None, *, board: ProgressBoard | None = None) -> Any:
    return SimpleNamespace(
        run_dir=str(tmp_path),
        plan=FaultPlan.parse(spec),
        workers=_Workers(board),
        events=_Events(),
        ledger=FaultLedger(str(tmp_path)),
    )


def _chaos(agent: Any, faults: list[Any]) -> AgentChaos:
    return AgentChaos(
        faults,
        node=0,
        answerable=agent.plan.home_faults(0, 2),
        run_dir=agent.run_dir,
        workers=agent.workers,
        events=agent.events,
        ledger=agent.ledger,
        join=lambda fault: True,
        kill_node=lambda: None,
    )


def _request(tmp_path: Path, name: str, content: bytes) -> None:
    requests = tmp_path / "chaos" / "requests"
    requests.mkdir(parents=True, exist_ok=True)
    (requests / name).write_bytes(content)


def test_malformed_requests_are_reported_once_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = _agent(tmp_path)
    chaos = _chaos(agent, [])
    good = time.time_ns()
    _request(tmp_path, "abc.json", b'{"spec": "kill rank=0 at=time:0s"}')  # int(name) failed
    _request(tmp_path, "12.json", b'{"spec": "kill rank=0 at=time:0s"}')  # collides with ids
    _request(tmp_path, f"{good - 5}.json", b'["spec"]')  # a JSON list
    _request(tmp_path, f"{good - 4}.json", b'{"spec": 7}')
    _request(tmp_path, f"{good - 3}.json", '{"spec": "kill rank=² at=time:0s"}'.encode())
    _request(tmp_path, f"{good - 2}.json", b"[" * 50_000)
    _request(tmp_path, f"{good - 1}.json", b"\xff\xfe")
    (tmp_path / "chaos" / "requests" / f"{good - 6}.json").mkdir()  # a directory
    _request(tmp_path, f"{good}.json", json.dumps({"spec": "kill rank=0 at=time:0s"}).encode())
    chaos.poll_requests()
    chaos.poll_requests()  # each bad file is reported once
    assert len(agent.events.notes) == 8, agent.events.notes
    assert all("ignored" in n and "\n" not in n for n in agent.events.notes)
    assert caplog.text.count("ignored") == 8
    (fault,) = chaos.pending  # the good request still arrived
    assert fault.id == good and fault.rank == 0


def test_requests_another_user_could_have_written_are_refused(tmp_path: Path) -> None:
    """A chaos request fires only from a file of the job's user that no one else can
    write (another user in the group once killed a rank of someone else's job)."""
    agent = _agent(tmp_path)
    chaos = _chaos(agent, [])
    now = time.time_ns()
    _request(tmp_path, f"{now - 1}.json", b'{"spec": "kill rank=0 at=time:0s"}')
    (tmp_path / "chaos" / "requests" / f"{now - 1}.json").chmod(0o666)
    chaos.poll_requests()
    assert not chaos.pending
    (note,) = agent.events.notes
    assert "refused" in note and "writable by other users" in note


def test_time_faults_count_from_the_first_step(tmp_path: Path) -> None:
    board = ProgressBoard(str(tmp_path / "board"), 1, create=True)
    try:
        agent = _agent(tmp_path, "kill rank=0 at=time:10s", board=board)
        chaos = _chaos(agent, list(agent.plan.faults))
        (fault,) = chaos.pending
        t = 1_000_000.0
        assert not chaos._due(fault, t + 3600)  # no step yet: the origin is unknown
        board.write(0, pid=os.getpid(), step=0, phase="step", generation=0, t_progress=t,
                    t_alive=t, p99_s=0.0)  # fmt: skip
        chaos._watch_first_step(t)
        assert chaos.first_step == t
        assert not chaos._due(fault, t + 9.9) and chaos._due(fault, t + 10.0)
        chaos._watch_first_step(t + 50)  # the origin never moves (restarts included)
        assert chaos.first_step == t
    finally:
        board.close()


def test_queued_requests_count_from_their_queue_time(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    chaos = _chaos(agent, [])
    queued = time.time_ns()
    _request(tmp_path, f"{queued}.json", b'{"spec": "hang rank=0 at=time:5s"}')
    chaos.poll_requests()
    (fault,) = chaos.pending
    assert chaos.first_step is None  # not needed for a queued request
    assert not chaos._due(fault, queued / 1e9 + 4.9) and chaos._due(fault, queued / 1e9 + 5)


def test_unfired_faults_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    agent = _agent(
        tmp_path,
        "kill rank=1 at=step:50; hang rank=0 at=time:1h; kill rank=2 at=step:3; "
        "kill rank=0 at=step:40",
    )
    chaos = _chaos(agent, [])
    agent.ledger.claim(agent.plan.faults[0], rank=1, pid=1)  # this one fired
    chaos.first_step = 1000.0
    chaos.last_tick = 1002.5  # the job ran 2.5 s from its first step, to step 12
    unfired = chaos.report_unfired()
    # rank 2 is node 1's
    assert [f.text for f in unfired] == ["hang rank=0 at=time:1h", "kill rank=0 at=step:40"]
    timed, stepped = agent.events.unfired
    assert timed["spec"] == "hang rank=0 at=time:1h" and timed["ran_s"] == 2.5
    ended = "the job ended first, 2.5 s after the first step, before the fault's 3600 s"
    assert timed["reason"] == ended
    assert stepped["reason"] == "the job ended at step 12 before step 40"
    assert stepped["last_step"] == 12 and stepped["domain"] == {"rank": 0, "node": None}
    assert caplog.text.count("never fired") == 2


def test_a_time_fault_with_no_step_says_so(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "kill rank=0 at=time:1s")
    chaos = _chaos(agent, [])
    chaos.report_unfired()
    (rec,) = agent.events.unfired
    assert "ever reported a step" in rec["reason"] and rec["ran_s"] == -1.0


_REQUEST_BODIES = st.one_of(
    st.binary(max_size=80),
    st.recursive(
        st.one_of(st.none(), st.integers(), st.text(max_size=30), st.floats()),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.just("spec"), inner, max_size=1)
        ),
        max_leaves=6,
    ).map(lambda doc: json.dumps(doc).encode()),
)


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(st.tuples(st.text(max_size=25), _REQUEST_BODIES), max_size=4))
def test_no_request_file_ends_the_loop(files: list[tuple[str, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        agent = _agent(Path(tmp))
        chaos = _chaos(agent, [])
        requests = Path(tmp) / "chaos" / "requests"
        requests.mkdir(parents=True)
        for i, (name, body) in enumerate(files):
            safe = "".join(c for c in name if c not in "/\x00") or "x"
            for candidate in (f"{safe}.json", f"{time.time_ns() + i}.json"):
                with contextlib.suppress(OSError):
                    (requests / candidate).write_bytes(body)
        with contextlib.redirect_stderr(io.StringIO()):
            chaos.poll_requests()  # never raises, whatever the files hold


def test_plain_script_slow_fault_sleeps_in_its_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`slow factor=3 steps=2` on a plain script: before optimizer steps 2 and 3 (its
    window) the hook sleeps twice the last step interval; claimed and logged once."""
    from stalwart.agent.processes import _plain_chaos
    from stalwart.metrics import read_events

    plan = FaultPlan.parse("slow rank=1 factor=3 at=step:2 steps=2; kill rank=0 at=step:2")
    chaos = _plain_chaos._PlainChaos(
        [f for f in plan.faults if f.rank == 1], str(tmp_path), rank=1, node=0
    )
    slept: list[float] = []
    monkeypatch.setattr(_plain_chaos.time, "sleep", slept.append)
    for step in range(1, 6):
        chaos.before(step, 0.5)
    assert slept == [1.0, 1.0]
    (injected,) = read_events(str(tmp_path / "events.jsonl")).events
    assert injected.kind == "fault_injected" and injected.get("domain") == {"rank": 1, "node": 0}
    assert list(FaultLedger(str(tmp_path)).fired()) == ["0"]
