"""The detectors, in-process: what each reports as a typed incident, and the records it
writes on the way (the hang decision itself is detection/test_hang.py's)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from stalwart.agent.detection._detectors import CrashDetector, HangWatch, NodeLossDetector
from stalwart.agent.detection.hang import HangConfig
from stalwart.agent.detection.incidents import NodeLost, WorkerExited
from stalwart.agent.detection.verdict import CrashLoops
from stalwart.agent.processes._workers import LocalWorkers, ProcessExit
from stalwart.chaos import FaultLedger
from stalwart.contract.board import ProgressBoard

from .._fakes import FakeEvents, FakeZygote


def _crashes(tmp_path: Path, limit: int = 2) -> tuple[CrashDetector, FakeEvents, list[str]]:
    board = ProgressBoard(str(tmp_path / f"board-{uuid.uuid4().hex[:6]}"), 4, create=True)
    workers = LocalWorkers([0, 1], board, FakeZygote())
    events, said = FakeEvents(), []
    detector = CrashDetector(node=0, run_dir=str(tmp_path), workers=workers,
                             hangs=HangWatch(HangConfig()), loops=CrashLoops(limit),
                             ledger=FaultLedger(str(tmp_path)), events=events,
                             say=said.append)  # fmt: skip
    return detector, events, said


def test_a_crash_is_reported_and_becomes_a_typed_incident(tmp_path: Path) -> None:
    detector, events, said = _crashes(tmp_path)
    incident = detector.examine(ProcessExit(1, 4242, 3, 0.0, ""))
    assert isinstance(incident, WorkerExited)
    assert (incident.rank, incident.cause, incident.verdict) == (1, "crash", None)
    assert (incident.failure.where, incident.failure.error) == ("start-up", "exit code 3")
    assert events.kinds() == ["fault_detected", "member_leave"]
    assert events.of("member_leave")[0]["reason"] == "exit rc 3"
    assert said and "rank 1 crashed" in said[0]


def test_the_same_failure_twice_carries_the_crash_loop_verdict(tmp_path: Path) -> None:
    detector, _, _ = _crashes(tmp_path, limit=2)
    assert detector.examine(ProcessExit(0, 10, -9, 0.0, "")).verdict is None
    verdict = detector.examine(ProcessExit(0, 11, -9, 0.0, "")).verdict
    assert verdict is not None and verdict.startswith("rank 0 failed 2 times in a row")


def test_a_hang_kill_is_not_reported_again_as_a_crash(tmp_path: Path) -> None:
    detector, events, _ = _crashes(tmp_path)
    incident = detector.examine(ProcessExit(0, 12, -9, 0.0, "hang"))
    assert incident.cause == "hang" and events.kinds() == ["member_leave"]


def test_a_collateral_kill_is_recovered_but_never_counted_as_the_ranks_failure(
    tmp_path: Path,
) -> None:
    # a survivor the agent killed because it waited in a collective of a generation
    # another rank's hang ended: no fault of its own, and no crash-loop verdict however
    # often it happens (it was charged before: one hang cost two ranks a failure)
    detector, events, _ = _crashes(tmp_path, limit=2)
    incidents = [detector.examine(ProcessExit(0, 20 + i, -9, 0.0, "collateral")) for i in range(3)]
    assert all(i.collateral and i.verdict is None for i in incidents)
    assert incidents[0].failure.cause == "collateral"
    assert events.kinds() == ["member_leave"] * 3  # no fault_detected: not a fault
    assert detector.last_failure is None
    # its own failure afterwards is its first
    assert detector.examine(ProcessExit(0, 30, -9, 0.0, "")).verdict is None


class _Nodes:  # the cluster and its coordinator (block), faked as one
    def __init__(self, lost: list[int], blocked: set[str]) -> None:
        self.lost, self.blocked, self.blocks = lost, blocked, []

    def lost_nodes(self) -> list[int]:
        lost, self.lost = self.lost, []
        return lost

    def ranks_of(self, node: int) -> list[int]:
        return [2 * node, 2 * node + 1]

    def watch_closed_at(self, node: int) -> float | None:
        return None

    def published(self, key: str) -> dict[str, Any] | None:
        return None

    def blocklisted(self) -> set[str]:
        return set(self.blocked)

    def block(self, member: str, reason: str) -> None:
        self.blocks.append(member)


def test_a_lost_node_is_isolated_and_reported_once(tmp_path: Path) -> None:
    nodes, events = _Nodes([1], set()), FakeEvents()
    detector = NodeLossDetector(nodes=nodes, coord=nodes, lease_s=3.0,  # the fake blocklists too
                                ledger=FaultLedger(str(tmp_path)), events=events,
                                say=lambda line: None)  # fmt: skip
    (lost,) = detector.check()
    assert lost == NodeLost(1, (2, 3), "agent lease expired (ttl 3.0s)", 3.0, False)
    assert nodes.blocks == ["node1"] and events.kinds() == ["fault_detected", "isolation"]
    assert detector.check() == []


def test_a_node_that_cordoned_itself_is_adopted_without_a_new_report(tmp_path: Path) -> None:
    nodes, events = _Nodes([1], {"node1"}), FakeEvents()
    detector = NodeLossDetector(nodes=nodes, coord=nodes, lease_s=3.0,  # the fake blocklists too
                                ledger=FaultLedger(str(tmp_path)), events=events,
                                say=lambda line: None)  # fmt: skip
    (lost,) = detector.check()
    assert lost.cordoned and lost.ranks == (2, 3) and events.records == [] and not nodes.blocks


def test_a_node_lost_after_a_rank_finished_the_job_is_not_adopted(tmp_path: Path) -> None:
    # the probe/finish race: node 1, isolated by a failing probe once rank 0 had passed
    # the finish barrier, used to be adopted: its ranks started again and waited for
    # peers that had exited, and the job ended failed instead of ok
    for blocked in ({"node1"}, set()):  # cordoned itself (a probe), or its lease expired
        nodes, events, said = _Nodes([1], blocked), FakeEvents(), []
        detector = NodeLossDetector(nodes=nodes, coord=nodes, lease_s=3.0,
                                    ledger=FaultLedger(str(tmp_path)), events=events,
                                    say=said.append, finished=lambda: 0)  # fmt: skip
        assert detector.check() == []
        (note,) = events.of("note")
        assert "ranks [2, 3] are not adopted" in note["message"]
        assert not any("adopting" in line for line in said)
