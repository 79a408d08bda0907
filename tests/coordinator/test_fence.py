"""A generation can only be moved by a live member: the bump's transaction checks the
caller's lease (its member key's create_revision) together with the number, under the
embedded store, over its TCP server and in a real etcd (coordinator/fence.py)."""

from __future__ import annotations

from functools import partial

import pytest

from stalwart.coordinator import Coordinator, CoordinatorConfig, Fence, GenerationChange
from stalwart.errors import FencedError

from .conftest import Backend, wait_until
from .test_coordinator import run_all

CFG = CoordinatorConfig(job_id="job", lease_ttl=1.0, heartbeat_interval=0.2)


def test_a_live_member_moves_the_generation(backend: Backend) -> None:
    coord = Coordinator(backend.store, CFG)
    member = coord.join("node0")
    fence = coord.fence_of(member)
    assert fence.key.endswith("/members/node0") and fence.create_revision > 0
    as_node0 = coord.as_member(fence)
    assert as_node0.advance_generation(0, "node 1 lost") == GenerationChange(True, 1)
    assert coord.generation() == 1
    member.leave()


def test_a_member_whose_lease_is_gone_cannot_move_the_job(backend: Backend) -> None:
    coord = Coordinator(backend.store, CFG)
    member = coord.join("node1")  # never heartbeats: cut from the store
    cut = coord.as_member(coord.fence_of(member))
    # the lease expires in the store (no client needed: etcd / the store expire it)
    assert wait_until(lambda: "node1" not in coord.members(), 30.0)
    with pytest.raises(FencedError, match="node1 cannot move the job past generation 0"):
        cut.advance_generation(0, "node 0 looks lost")
    assert coord.generation() == 0  # nothing moved, nor the rendezvous of generation 0
    assert coord.generation_meta() == {}


def test_a_rejoined_member_does_not_pass_with_its_old_proof(backend: Backend) -> None:
    coord = Coordinator(backend.store, CFG)
    first = coord.join("node1")
    old = coord.fence_of(first)
    first.leave()  # revoked: its key is gone
    again = coord.join("node1")  # same id, a new key: a new create_revision
    assert coord.fence_of(again).create_revision != old.create_revision
    with pytest.raises(FencedError):
        coord.as_member(old).advance_generation(0, "stale agent after a heal")
    assert coord.as_member(coord.fence_of(again)).advance_generation(0, "fresh").won
    again.leave()


def test_an_old_generation_caller_moves_nothing(backend: Backend) -> None:
    coord = Coordinator(backend.store, CFG)
    member = coord.join("node0")
    live = coord.as_member(coord.fence_of(member))
    assert live.advance_generation(0, "first").won
    assert live.advance_generation(1, "second").won
    stale = live.advance_generation(0, "a member still in generation 0")
    assert stale == GenerationChange(False, 2)  # it learns the current one
    assert coord.generation_meta()["reason"] == "second"
    member.leave()


def test_of_racing_live_members_one_wins_and_the_fenced_one_never(backend: Backend) -> None:
    coord = Coordinator(backend.store, CFG)
    members = [coord.join(f"node{i}") for i in range(3)]
    coords = [coord.as_member(coord.fence_of(m)) for m in members]
    members[2].leave()  # node2's lease is gone before the race
    results = run_all([partial(c.advance_generation, 0, "a node was lost") for c in coords])
    assert isinstance(results[2], FencedError)
    assert sorted(r.won for r in results[:2]) == [False, True]
    assert coord.generation() == 1
    for m in members[:2]:
        m.leave()


def test_fence_of_a_member_without_a_lease_is_refused(backend: Backend) -> None:
    coord = Coordinator(backend.store, CFG)
    member = coord.join("node3")
    member.leave()
    with pytest.raises(FencedError, match="node3"):
        coord.fence_of(member)


def test_a_fence_needs_a_key_and_a_revision() -> None:
    with pytest.raises(ValueError, match="revision > 0"):
        Fence("/stalwart/job/members/node0", 0, "node0")
