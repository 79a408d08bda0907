"""Coordinator: generations, membership by lease, blocklist, rendezvous, fenced commits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from _load import scaled

from stalwart.coordinator import (
    AlreadyCommittedError,
    BlocklistedError,
    Coordinator,
    CoordinatorConfig,
    MemberExistsError,
    MemoryStore,
    RendezvousTimeoutError,
)
from stalwart.errors import ConfigError, FencedError

from .conftest import Backend

FAST = CoordinatorConfig(job_id="job", lease_ttl=0.5, heartbeat_interval=0.1)
# members that must not expire while the test runs (it checks something else): a lease
# that outlives a loaded machine's pauses, where 0.5 s without a heartbeat does not
STEADY = CoordinatorConfig(job_id="job", lease_ttl=60.0, heartbeat_interval=1.0)


def run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` in threads started together; return results or raised exceptions."""
    results: list[Any] = [None] * len(fns)
    start = threading.Barrier(len(fns))

    def wrap(i: int) -> None:
        start.wait()
        try:
            results[i] = fns[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_generation_bump_has_exactly_one_winner(backend: Backend) -> None:
    coords = [Coordinator(backend.new_client(), FAST) for _ in range(5)]
    assert coords[0].generation() == 0
    changes = run_all([partial(c.advance_generation, 0, "rank 3 died") for c in coords])
    assert sorted(ch.won for ch in changes) == [False] * 4 + [True]
    assert {ch.generation for ch in changes} == {1}
    assert coords[0].generation_meta()["reason"] == "rank 3 died"


def test_join_members_and_leave(backend: Backend) -> None:
    coord = Coordinator(backend.store, FAST)
    with coord.join("w0", node="n0", info={"rank": 0}) as member:
        info = coord.members()["w0"]
        assert (info.node, info.info) == ("n0", {"rank": 0})
        with pytest.raises(MemberExistsError):
            coord.join("w0")
        assert member.lease != 0
    assert coord.members() == {}
    coord.join("w0").leave()  # the id is free again


def test_lease_expiry_is_the_failure_signal(backend: Backend) -> None:
    coord = Coordinator(backend.store, FAST)
    rev = backend.store.range("").revision
    with coord.watch_members(rev + 1) as watch:
        coord.join("silent")  # joins, never heartbeats
        with coord.join("beating") as beating:
            beating.start_heartbeat()
            started = time.monotonic()
            events = watch.get(5.0) + watch.get(5.0)
            while not any(e.kind == "left" for e in events):
                events += watch.get(5.0)
                assert time.monotonic() - started < 10
            left = [e.member_id for e in events if e.kind == "left"]
            assert left == ["silent"]
            assert time.monotonic() - started >= FAST.lease_ttl * 0.5
            assert list(coord.members()) == ["beating"]
        assert [(e.kind, e.member_id) for e in watch.get(5.0)] == [("left", "beating")]


def test_heartbeat_reports_a_lost_lease(backend: Backend) -> None:
    coord = Coordinator(backend.store, FAST)
    lost = threading.Event()
    member = coord.join("w1")
    member.start_heartbeat(on_lost=lambda exc: lost.set())
    backend.store.revoke(member.lease)  # as if the lease expired during a partition
    assert lost.wait(5.0)
    assert member.lost is not None
    member.leave()


def test_k_failures_in_window_blocklist() -> None:
    now = [1000.0]
    cfg = CoordinatorConfig(job_id="j", failure_threshold=3, failure_window=60)
    coord = Coordinator(MemoryStore(), cfg, clock=lambda: now[0])
    assert coord.record_failure("w2", "exit 1") is False
    now[0] += 61  # the first failure falls out of the window
    assert coord.record_failure("w2", "exit 1") is False
    assert coord.record_failure("w2", "hang") is False
    assert coord.blocklisted() == {}
    assert coord.record_failure("w2", "ECC error") is True
    entry = coord.blocklisted()["w2"]
    assert entry.failures == 3 and "ECC error" in entry.reason and entry.at == now[0]
    with pytest.raises(BlocklistedError, match="ECC error"):
        coord.join("w2")
    assert coord.members() == {}  # the refused join left nothing behind
    coord.unblock("w2")
    coord.join("w2").leave()
    assert coord.record_failure("w2", "exit 1") is False  # its history was forgotten


def test_block_directly(backend: Backend) -> None:
    coord = Coordinator(backend.store, FAST)
    coord.block("n7", "disk full")
    with pytest.raises(BlocklistedError, match="disk full"):
        coord.join("n7")


def test_stale_generation_cannot_commit(backend: Backend) -> None:
    coord = Coordinator(backend.store, FAST)
    assert coord.commit_step(0, 1, by="w0").step == 1
    gen = coord.advance_generation(0, "failure").generation
    with pytest.raises(FencedError, match="generation 0 is stale"):
        coord.commit_step(0, 2)
    with pytest.raises(FencedError):
        coord.commit_checkpoint(0, 2)
    last = coord.last_step()
    assert last is not None and (last.step, last.generation) == (1, 0)
    assert coord.latest_checkpoint() is None
    # the new generation rolls back to step 1 and goes on
    assert coord.commit_step(gen, 1).generation == gen
    assert coord.commit_checkpoint(gen, 2, {"manifest": "ckpt/2/manifest.json"}).step == 2
    latest = coord.latest_checkpoint()
    assert latest is not None and latest.meta == {"manifest": "ckpt/2/manifest.json"}


def test_commits_happen_once_and_move_forward(backend: Backend) -> None:
    coord = Coordinator(backend.store, FAST)
    coord.commit_step(0, 5)
    with pytest.raises(AlreadyCommittedError):
        coord.commit_step(0, 5)
    with pytest.raises(AlreadyCommittedError):
        coord.commit_step(0, 4)
    coord.commit_checkpoint(0, 5)
    with pytest.raises(AlreadyCommittedError):
        coord.commit_checkpoint(0, 5)


def test_partitioned_halves_cannot_both_commit(backend: Backend) -> None:
    """Both halves saw generation 3 fail; each bumps and commits. Only one may succeed."""
    setup = Coordinator(backend.store, FAST)
    for g in range(3):
        setup.advance_generation(g, "setup")
    halves = [Coordinator(backend.new_client(), FAST) for _ in range(2)]

    def bump_and_commit(coord: Coordinator) -> int:
        change = coord.advance_generation(3, "partition")
        return coord.commit_checkpoint(change.generation if change.won else 3, 10).generation

    results = run_all([partial(bump_and_commit, c) for c in halves])
    assert sorted(type(r).__name__ for r in results) == ["FencedError", "int"]
    latest = setup.latest_checkpoint()
    assert latest is not None and latest.generation == 4


def test_rendezvous_gathers_members_and_times_out(backend: Backend) -> None:
    coords = [Coordinator(backend.new_client(), STEADY) for _ in range(3)]
    members = [c.join(f"w{i}") for i, c in enumerate(coords)]
    pairs = list(zip(coords, members, strict=True))
    try:
        got = run_all([partial(c.rendezvous, m, 0, 3, timeout=10) for c, m in pairs])
        assert got == [["w0", "w1", "w2"]] * 3
        got = run_all([partial(c.barrier, m, 0, "ckpt", 3, timeout=10) for c, m in pairs])
        assert got == [["w0", "w1", "w2"]] * 3
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="1 of 2 members"):
            coords[0].barrier(members[0], 0, "lonely", 2, timeout=0.3)
        assert time.monotonic() - started < scaled(3)  # not the rendezvous' 10 s
    finally:
        for m in members:
            m.leave()


def test_rendezvous_is_fenced_when_the_generation_moves(backend: Backend) -> None:
    coord = Coordinator(backend.store, STEADY)
    bumper = Coordinator(backend.new_client(), FAST)
    with coord.join("w0") as member:
        timer = threading.Timer(0.2, lambda: bumper.advance_generation(0, "another failure"))
        timer.start()
        started = time.monotonic()
        try:
            with pytest.raises(FencedError, match="generation 0 is stale"):
                coord.rendezvous(member, 0, 5, timeout=10)
        finally:
            timer.join()
        assert time.monotonic() - started < scaled(5)  # not the rendezvous' 10 s
        with pytest.raises(FencedError):
            coord.rendezvous(member, 0, 1, timeout=1)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"job_id": "a/b"}, "job id"),
        ({"lease_ttl": 0}, "lease_ttl"),
        ({"lease_ttl": 1.0, "heartbeat_interval": 2.0}, "heartbeat_interval"),
        ({"failure_threshold": 0}, "failure_threshold"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        CoordinatorConfig(**kwargs)
