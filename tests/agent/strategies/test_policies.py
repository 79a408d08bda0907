"""The recovery policies, in-process: real LocalWorkers (fake zygote), a real
JobGeneration and Coordinator over a MemoryStore; what each strategy does about a
worker's failure and a lost node, and when it ends the job instead."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _load import scaled

from stalwart.agent._outcome import Cordoned, RunFailed
from stalwart.agent.cluster._generation import JobGeneration
from stalwart.agent.detection.incidents import NodeLost, WorkerExited
from stalwart.agent.detection.verdict import Failure
from stalwart.agent.processes._workers import LocalWorkers, WorkerState
from stalwart.agent.strategies import choose_policy
from stalwart.agent.strategies._async import ReplicaGroups
from stalwart.agent.strategies._elastic import ElasticPolicy, Joins
from stalwart.agent.strategies._inplace import InPlace
from stalwart.agent.strategies._restart import RestartAll
from stalwart.agent.strategies.policy import RecoveryParts
from stalwart.chaos import FaultLedger, FaultPlan
from stalwart.contract.board import ProgressBoard
from stalwart.contract.env import Strategy, WorkerEnv
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.coordinator.elastic_keys import Keys, replica_root

from .._fakes import FakeEvents, FakeLaunch, FakeZygote

_ZYGOTES: dict[int, FakeZygote] = {}  # id(LocalWorkers) -> the fake it forks through


def _parts(tmp_path: Path, *, node: int = 0, nproc: int = 2, **cfg: Any) -> RecoveryParts:
    job = f"t-{uuid.uuid4().hex[:8]}"
    fields = {"max_restarts": 3, "min_world": 2, "world_size": 4, "runtime": WorkerEnv(), **cfg}
    config = SimpleNamespace(job=job, node_rank=node, nproc_per_node=nproc, **fields)
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id=job))
    board = ProgressBoard(str(tmp_path / f"board-{job}"), 8, create=True)
    ranks = list(range(node * nproc, (node + 1) * nproc))
    zygote = FakeZygote()
    workers = LocalWorkers(ranks, board, zygote)
    _ZYGOTES[id(workers)] = zygote
    events, launch, said = FakeEvents(), FakeLaunch(), []
    gen = JobGeneration(coord, launch, events, world_size=4)
    parts = RecoveryParts(config, workers, gen, coord, launch, events,  # type: ignore[arg-type]
                          FaultLedger(str(tmp_path)), None, said.append)  # fmt: skip
    workers.wire(lambda w, extra: {"rank": w.rank}, parts.joined, assign_spares=False)
    for w in workers:
        parts.spawn(w)
    return parts


def _failed(
    parts: RecoveryParts, rank: int, *, verdict: str | None = None, cause: str = "crash"
) -> WorkerExited:
    w = parts.workers[rank]
    parts.workers.on_message({"op": "spawned", "id": f"rank-{rank}", "pid": 1000 + rank})
    parts.workers.on_message({"op": "exit", "pid": w.pid, "rc": 1, "t": 0.0})
    assert w.state is WorkerState.DEAD
    return WorkerExited(rank, w.pid, 1, cause, Failure(rank, "step 5", "ValueError: x", cause),
                        verdict, collateral=cause == "collateral")  # fmt: skip


def _sent(parts: RecoveryParts) -> list[dict[str, Any]]:
    return list(_ZYGOTES[id(parts.workers)].sent)


def test_in_place_replaces_only_the_failed_rank_in_the_next_generation(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    policy = InPlace(parts, name="flash", assigns_spares=False)
    before = len(_sent(parts))
    policy.on_incident(_failed(parts, 1))
    assert parts.generation.current == 1
    (begin,) = parts.events.of("recovery_begin")  # type: ignore[attr-defined]
    assert begin == {"strategy": "flash", "generation": 1, "cause": "crash"}
    assert [m["id"] for m in _sent(parts)[before:]] == ["rank-1"]
    assert parts.workers[1].state is WorkerState.STARTING
    assert parts.workers[0].state is WorkerState.STARTING  # untouched: never reported spawned


def test_in_place_ends_the_job_on_a_crash_loop_verdict(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    with pytest.raises(RunFailed, match="same way again"):
        InPlace(parts, name="flash", assigns_spares=False).on_incident(
            _failed(parts, 0, verdict="rank 0 failed 3 times: it will fail the same way again")
        )
    assert parts.launch.records["verdict"]["line"].startswith("rank 0")  # type: ignore[attr-defined]


def test_in_place_blocklists_a_rank_that_fails_too_often(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    policy = InPlace(parts, name="spare", assigns_spares=True)
    policy.on_incident(_failed(parts, 1))
    policy.on_incident(_failed(parts, 1))
    with pytest.raises(RunFailed, match=r"rank 1 blocklisted .* at step 5: ValueError: x"):
        policy.on_incident(_failed(parts, 1))
    assert "rank1" in parts.coord.blocklisted()


def test_collateral_kills_are_recovered_without_charging_the_rank_or_its_node(
    tmp_path: Path,
) -> None:
    parts = _parts(tmp_path, node=1)
    policy = InPlace(parts, name="flash", assigns_spares=False)
    for _ in range(4):  # past the isolation threshold (3), had they counted
        policy.on_incident(_failed(parts, 2, cause="collateral"))
    assert parts.coord.blocklisted() == {}
    assert parts.generation.current == 4  # each recovered: a new generation, respawned
    assert parts.workers[2].state is WorkerState.STARTING
    assert [b["cause"] for b in parts.events.of("recovery_begin")] == ["collateral"] * 4  # type: ignore[attr-defined]
    policy.on_incident(_failed(parts, 2))  # its own failures still count, from one
    policy.on_incident(_failed(parts, 2))
    with pytest.raises(RunFailed, match="rank 2 blocklisted"):
        policy.on_incident(_failed(parts, 2))


def _finished(parts: RecoveryParts, rank: int) -> None:
    w = parts.workers[rank]
    parts.workers.on_message({"op": "spawned", "id": f"rank-{rank}", "pid": 1000 + rank})
    parts.workers.on_message({"op": "exit", "pid": w.pid, "rc": 0, "t": 0.0})
    assert w.state is WorkerState.DONE


def test_a_rank_failing_after_its_peer_finished_ends_the_job_instead_of_a_replacement(
    tmp_path: Path,
) -> None:
    # rank 0 exited 0 (past the finish barrier); rank 1 then fails (its final save): a
    # replacement would wait 300 s for a rank 0 that never comes back, and again
    parts = _parts(tmp_path)
    policy = InPlace(parts, name="flash", assigns_spares=False)
    _finished(parts, 0)
    assert parts.launch.records["finished"] == {"rank": 0, "node": 0}  # type: ignore[attr-defined]
    before = len(_sent(parts))
    with pytest.raises(RunFailed, match=r"rank 1 failed at step 5 \(ValueError: x\) when rank 0"):
        policy.on_incident(_failed(parts, 1))
    assert _sent(parts)[before:] == [] and parts.generation.current == 0
    assert "resume from the last checkpoint" in parts.launch.records["verdict"]["line"]  # type: ignore[attr-defined]


def test_a_peer_that_finished_on_another_node_or_passed_the_barrier_counts_too(
    tmp_path: Path,
) -> None:
    parts = _parts(tmp_path, node=1)
    policy = InPlace(parts, name="flash", assigns_spares=False)
    parts.launch.publish("finished", {"rank": 0, "node": 0})
    with pytest.raises(RunFailed, match="when rank 0 had finished the job"):
        policy.on_incident(_failed(parts, 3))
    # on this node: a peer whose board says done (its process not reaped yet)
    parts = _parts(tmp_path)
    policy = InPlace(parts, name="flash", assigns_spares=False)
    parts.workers.on_message({"op": "spawned", "id": "rank-0", "pid": 1000})
    parts.workers.board.write(0, pid=1000, step=6, phase="done", generation=0,
                              t_progress=0.0, t_alive=0.0, p99_s=0.1)  # fmt: skip
    parts.workers.judged()  # the agent's next look at the board tells the other nodes
    assert parts.launch.records["finished"] == {"rank": 0, "node": 0}  # type: ignore[attr-defined]
    with pytest.raises(RunFailed, match="when rank 0 had finished the job"):
        policy.on_incident(_failed(parts, 1))


@pytest.mark.parametrize("strategy", ["spare", "restart"])
def test_a_rank_failing_after_it_passed_the_finish_barrier_ends_the_job(
    tmp_path: Path, strategy: str
) -> None:
    """Rank 0 passed the finish barrier, then failed after training (a Trainer script's
    model card) before any peer's board said done: the job had finished, so neither a
    spare nor a restart is started (it would wait for peers that are leaving)."""
    parts = _parts(tmp_path)
    policy: Any = (
        InPlace(parts, name="spare", assigns_spares=True)
        if strategy == "spare"
        else RestartAll(parts)
    )
    base = _failed(parts, 0)
    parts.workers.board.write(0, pid=base.pid, step=16, phase="done", generation=0,
                              t_progress=0.0, t_alive=0.0, p99_s=0.1)  # fmt: skip
    failure = Failure(0, "after step 16", "KeyError: 'Model Preparation Time'", "crash")
    ex = WorkerExited(0, base.pid, 1, "crash", failure, None)
    before = len(_sent(parts))
    with pytest.raises(RunFailed, match=r"rank 0 failed after step 16 \(KeyError.*after the job"):
        policy.on_incident(ex)
    assert _sent(parts)[before:] == [] and parts.generation.current == 0
    assert "not restarted" in parts.launch.records["verdict"]["line"]  # type: ignore[attr-defined]


def test_a_node_other_than_0_that_fails_too_often_cordons_itself(tmp_path: Path) -> None:
    parts = _parts(tmp_path, node=1)
    policy = InPlace(parts, name="flash", assigns_spares=False)
    policy.on_incident(_failed(parts, 2))
    policy.on_incident(_failed(parts, 3))
    with pytest.raises(Cordoned):
        policy.on_incident(_failed(parts, 2))
    assert "node1" in parts.coord.blocklisted()


def test_in_place_starts_a_lost_nodes_ranks_here(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    for rank in (2, 3):
        parts.workers.adopt(rank, rank % 2, parts.workers.free_slot())
    InPlace(parts, name="flash", assigns_spares=False).on_incident(
        NodeLost(1, (2, 3), "agent lease expired", 3.0, False)
    )
    assert parts.generation.current == 1
    assert [m["id"] for m in _sent(parts)[-2:]] == ["rank-2", "rank-3"]


def test_a_node_lost_after_a_rank_finished_the_job_is_not_adopted(tmp_path: Path) -> None:
    # the probe/finish race: node 1 left (isolated by a failing probe) after the finish
    # barrier; adopting its ranks would start processes that wait for exited peers
    from stalwart.agent.detection._finished import finished_rank, skip_adoption

    parts = _parts(tmp_path)
    lost = NodeLost(1, (2, 3), "cordoned", 0.0, True)
    nothing = finished_rank(parts.workers, parts.launch, 4)
    assert nothing is None and not skip_adoption(lost, nothing, parts.events, parts.say)
    assert parts.events.of("note") == []  # type: ignore[attr-defined]
    # rank 0's board says done (its process not reaped yet): the barrier passed
    parts.workers.on_message({"op": "spawned", "id": "rank-0", "pid": 1000})
    parts.workers.board.write(0, pid=1000, step=6, phase="done", generation=0,
                              t_progress=0.0, t_alive=0.0, p99_s=0.1)  # fmt: skip
    done = finished_rank(parts.workers, parts.launch, 4)
    assert done == 0 and skip_adoption(lost, done, parts.events, parts.say)
    (note,) = parts.events.of("note")  # type: ignore[attr-defined]
    assert "ranks [2, 3] are not adopted" in note["message"]
    # another node's rank finished (its launch record): the same
    other = _parts(tmp_path, node=1)
    other.launch.publish("finished", {"rank": 0, "node": 0})
    assert finished_rank(other.workers, other.launch, 4) == 0
    other.launch.publish("finished", {"rank": 9, "node": 0})  # out of the world: ignored
    assert finished_rank(other.workers, other.launch, 4) is None


def test_restart_all_restarts_every_worker_on_a_fresh_port(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    policy = RestartAll(parts)
    before = len(_sent(parts))
    policy.on_incident(_failed(parts, 0))
    assert parts.generation.restarts == 1 and parts.generation.current == 1
    assert str(parts.coord.generation_meta()["reason"]).startswith("restart after crash")
    assert parts.launch.records["master-1"] == {"port": parts.generation.master_port}  # type: ignore[attr-defined]
    assert sorted(m["id"] for m in _sent(parts)[before:]) == ["rank-0", "rank-1"]


def test_restart_all_ends_the_job_when_the_restarts_are_spent(tmp_path: Path) -> None:
    parts = _parts(tmp_path, max_restarts=0)
    with pytest.raises(RunFailed, match="no restarts left"):
        RestartAll(parts).on_incident(_failed(parts, 1))


def test_elastic_drops_a_dead_member_and_starts_it_again_with_a_new_incarnation(
    tmp_path: Path,
) -> None:
    parts = _parts(tmp_path)
    policy = ElasticPolicy(parts, Joins(parts))
    parts.workers.wire(lambda w, extra: policy.worker_env(w), parts.joined, assign_spares=False)
    keys = Keys(parts.cfg.job)
    first = policy.worker_env(parts.workers[1])["incarnation"]
    policy.on_incident(_failed(parts, 1))
    kv = parts.coord.store.get(keys.member(keys.alive, 1))
    assert kv is not None and kv.value.decode() != first  # alive again, a new incarnation
    assert parts.workers[1].state is WorkerState.STARTING
    assert policy.judges_generation is False


def test_elastic_lets_a_member_that_fails_too_often_go_and_ends_below_min(
    tmp_path: Path,
) -> None:
    parts = _parts(tmp_path, min_world=2)
    policy = ElasticPolicy(parts, Joins(parts))
    policy.on_incident(_failed(parts, 1))
    policy.on_incident(_failed(parts, 1))
    with pytest.raises(RunFailed, match=r"member 1 failed 3 times in 10 min .* below MIN 2"):
        policy.on_incident(_failed(parts, 1))
    assert parts.workers[1].state is WorkerState.GONE
    assert "rank1" in parts.coord.blocklisted()


def test_async_drops_the_failed_group_from_the_rounds_and_restarts_it(tmp_path: Path) -> None:
    """No generation for the others to re-form; the group's alive key is gone at once,
    so the other groups stop waiting for it (runtime/replica_groups/_rounds.py)."""
    parts = _parts(tmp_path)
    store, root = parts.coord.store, replica_root(parts.cfg.job)
    for g in (0, 1):
        store.put(f"{root}m/alive/{g}", b'{"inc": "x", "round": 0}')
    before = len(_sent(parts))
    ReplicaGroups(parts).on_incident(_failed(parts, 1))
    assert store.get(f"{root}m/alive/1") is None and store.get(f"{root}m/alive/0") is not None
    assert parts.events.of("replica_drop") == [{"group": 1, "rank": 1, "cause": "crash"}]  # type: ignore[attr-defined]
    assert parts.generation.current == 0
    assert [m["id"] for m in _sent(parts)[before:]] == ["rank-1"]


def test_async_restarts_a_group_of_two_as_one(tmp_path: Path) -> None:
    """--replica-groups 2 of 4 workers: rank 1 dies, so its group peer rank 0 (waiting
    in its failed step) is killed, both start again one life later (the incarnation
    their process groups are named by); group 1 is untouched."""
    parts = _parts(tmp_path, runtime=WorkerEnv(replica_groups=2))
    policy = ReplicaGroups(parts)
    peer = subprocess.Popen(["sleep", "60"])
    try:
        parts.workers.on_message({"op": "spawned", "id": "rank-0", "pid": peer.pid})
        assert policy.worker_env(parts.workers[0]) == {"incarnation": "0"}
        before = len(_sent(parts))
        policy.on_incident(_failed(parts, 1))
        assert peer.wait(timeout=scaled(30)) == -signal.SIGKILL
    finally:
        peer.kill()
    assert parts.events.of("replica_drop") == [{"group": 0, "rank": 1, "cause": "crash"}]  # type: ignore[attr-defined]
    assert sorted(m["id"] for m in _sent(parts)[before:]) == ["rank-0", "rank-1"]
    assert policy.worker_env(parts.workers[0]) == {"incarnation": "1"}
    # the killed peer's exit is no failure: its rank runs again already
    parts.workers.on_message({"op": "exit", "pid": peer.pid, "rc": -9, "t": 0.0})
    assert parts.workers[0].state is WorkerState.STARTING


def test_async_ends_the_job_when_a_group_fails_too_often(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    policy = ReplicaGroups(parts)
    policy.on_incident(_failed(parts, 0))
    policy.on_incident(_failed(parts, 0))
    with pytest.raises(RunFailed, match=r"replica group 0 \(rank 0\) failed 3 times"):
        policy.on_incident(_failed(parts, 0))


def test_the_factory_is_the_one_place_a_strategy_name_is_read(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    joins = Joins(parts)
    chosen = {s.value: choose_policy(s, parts, joins) for s in Strategy}
    assert {s: p.name for s, p in chosen.items()} == {s: s for s in chosen}
    assert [s for s, p in chosen.items() if p.assigns_spares] == ["spare"]
    assert isinstance(chosen["elastic"], ElasticPolicy)


def _sharded(tmp_path: Path) -> tuple[RecoveryParts, ElasticPolicy, Joins]:
    """A 4-worker FSDP2 job under elastic whose workers said it is sharded."""
    parts = _parts(tmp_path, nproc=4, min_world=3)
    joins = Joins(parts)
    policy = ElasticPolicy(parts, joins)
    parts.workers.wire(lambda w, extra: policy.worker_env(w), parts.joined, assign_spares=False)
    parts.coord.store.put(Keys(parts.cfg.job).sharded, b"1")
    for w in parts.workers:
        policy.worker_env(w)  # alive, as their first start made them
    return parts, policy, joins


def _left_for_good(parts: RecoveryParts, rank: int) -> WorkerExited:
    """A ``permanent`` kill of ``rank`` (its process is the one _failed ends)."""
    rec = {"kind": "kill", "rank": rank, "pid": 1000 + rank, "permanent": True}
    parts.ledger.claim_id(f"kill-{rank}", rec)
    return _failed(parts, rank)


def _spawned(parts: RecoveryParts, before: int) -> dict[str, tuple[int, int]]:
    """rank-N -> (rank, world size) of the processes started since ``before``."""
    return {
        m["id"]: (m["spec"].get("rank"), m["spec"].get("world_size"))
        for m in _sent(parts)[before:]
        if m["op"] == "spawn"
    }


def test_a_sharded_job_shrinks_by_restarting_every_member_at_the_smaller_size(
    tmp_path: Path,
) -> None:
    """FSDP2 cannot go on at another size in place: the survivors start again, renumbered
    densely in launch-rank order, with the new world size (agent/strategies/_elastic.py)."""
    parts, policy, _ = _sharded(tmp_path)
    before = len(_sent(parts))
    policy.on_incident(_left_for_good(parts, 1))
    assert parts.workers[1].state is WorkerState.GONE
    assert _spawned(parts, before) == {"rank-0": (0, 3), "rank-2": (1, 3), "rank-3": (2, 3)}
    assert parts.generation.current == 1 and parts.generation.restarts == 1
    assert str(parts.coord.generation_meta()["reason"]).startswith("restart after member 1")
    resize = parts.events.of("resize")  # type: ignore[attr-defined]
    assert [(r["from_world_size"], r["world_size"], r["reason"]) for r in resize] == [
        (4, 3, "shrink")
    ]
    assert parts.events.of("generation")[-1]["world_size"] == 3  # type: ignore[attr-defined]


def test_a_sharded_job_grows_back_when_the_member_joins(tmp_path: Path) -> None:
    parts, policy, joins = _sharded(tmp_path)
    policy.on_incident(_left_for_good(parts, 3))
    before = len(_sent(parts))
    (join,) = FaultPlan.parse("join rank=3 at=step:20").faults
    assert joins.fire(join)
    assert _spawned(parts, before) == {f"rank-{r}": (r, 4) for r in range(4)}
    resize = parts.events.of("resize")  # type: ignore[attr-defined]
    assert [(r["from_world_size"], r["world_size"]) for r in resize] == [(4, 3), (3, 4)]


def test_a_sharded_member_started_again_restarts_all_at_the_same_size(tmp_path: Path) -> None:
    parts, policy, _ = _sharded(tmp_path)
    before = len(_sent(parts))
    policy.on_incident(_failed(parts, 2))  # not permanent: it comes back at once
    assert _spawned(parts, before) == {f"rank-{r}": (r, 4) for r in range(4)}
    assert parts.events.of("resize") == []  # type: ignore[attr-defined]


def test_a_sharded_job_below_min_ends_with_one_line(tmp_path: Path) -> None:
    parts, policy, _ = _sharded(tmp_path)
    policy.on_incident(_left_for_good(parts, 3))
    with pytest.raises(RunFailed, match=r"2 members, fewer than its minimum 3; lower MIN"):
        policy.on_incident(_left_for_good(parts, 2))
