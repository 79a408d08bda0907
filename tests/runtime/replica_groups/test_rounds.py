"""The synchronisation rounds of --strategy async in the store (runtime/replica_groups/_rounds.py):
who is waited for, who is dropped, what a late or rejoining group reads."""

from __future__ import annotations

import threading

import pytest

from stalwart.coordinator import MemoryStore
from stalwart.coordinator.elastic_keys import replica_root
from stalwart.runtime.replica_groups._rounds import CHUNK, RoundError, Rounds

JOB = "j"


def _groups(store: MemoryStore, n: int, wait_s: float = 30.0) -> list[Rounds]:
    rounds = [Rounds(store, JOB, g, n, wait_s) for g in range(n)]
    for r in rounds:
        r.announce("inc", 0)
    return rounds


@pytest.mark.timeout(30)
def test_every_live_group_is_waited_for() -> None:
    store = MemoryStore()
    a, b = _groups(store, 2)
    a.contribute(1, b"a")
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(a.agree(1)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and store.get(f"{replica_root(JOB)}m/roster/1") is None
    b.contribute(1, b"b" * (CHUNK + 5))  # two chunks
    assert b.agree(1) == [0, 1]
    t.join()
    assert got == [[0, 1]]
    assert a.contribution(1, 1) == b"b" * (CHUNK + 5)


@pytest.mark.timeout(30)
def test_a_failed_group_is_not_waited_for() -> None:
    """Its agent deleted its alive key: the round is decided without it, at once."""
    store = MemoryStore()
    a, _ = _groups(store, 2)
    store.delete(f"{replica_root(JOB)}m/alive/1")
    a.contribute(1, b"a")
    assert a.agree(1) == [0]


@pytest.mark.timeout(30)
def test_a_rejoined_group_is_expected_from_the_next_round() -> None:
    store = MemoryStore()
    a, b = _groups(store, 2)
    b.announce("inc2", 3)  # it received round 3's global state
    a.contribute(3, b"a")
    assert a.agree(3) == [0]  # not waited for at the round it joined at
    a.contribute(4, b"a")
    t = threading.Thread(target=a.agree, args=(4,))
    t.start()
    t.join(0.2)
    assert t.is_alive()
    b.contribute(4, b"b")
    t.join()
    assert a.agreed(4) == [0, 1]


@pytest.mark.timeout(30)
def test_a_late_group_reads_the_roster_and_the_global_state() -> None:
    store = MemoryStore()
    a, b = _groups(store, 2, wait_s=0.1)  # b never comes: a stops waiting
    a.contribute(1, b"a")
    assert a.agree(1) == [0]
    assert a.publish(1, b"global-1")
    assert not b.publish(1, b"other")  # published once, by the first member
    assert b.agreed(1) == [0]
    assert b.global_state(1) == b"global-1"
    assert b.latest() == 1


def test_old_rounds_are_pruned_and_a_missing_one_is_an_error() -> None:
    store = MemoryStore()
    (a,) = _groups(store, 1)
    for r in (1, 2, 3):
        a.contribute(r, b"x")
        a.agree(r)
        a.publish(r, b"g%d" % r)
        a.prune(r)
    assert a.latest() == 3
    assert a.global_state(2) == b"g2"
    with pytest.raises(RoundError, match="never published"):
        a.global_state(1)
    with pytest.raises(RoundError, match="gone"):
        a.contribution(1, 0)


@pytest.mark.timeout(30)
def test_a_relaunch_resumes_from_the_newest_step_every_group_holds() -> None:
    store = MemoryStore()
    a, b = _groups(store, 2)
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(a.persisted([10, 20, 30])))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waits for every group's list
    assert b.persisted([20, 10]) == [10, 20]  # group 1 never persisted step 30
    t.join()
    assert got == [[10, 20]]


def test_a_group_that_never_says_is_an_error() -> None:
    (a, _) = _groups(MemoryStore(), 2, wait_s=0.1)
    with pytest.raises(RoundError, match="missing groups' logs"):
        a.persisted([10])


def test_the_members_of_a_restarted_group_rejoin_at_one_round() -> None:
    """The first member's view of the newest round holds for the others (they may read
    the store after another round was published) and for nothing else: a later life
    decides anew."""
    store = MemoryStore()
    first, second = Rounds(store, JOB, 0, 2, 1.0), Rounds(store, JOB, 0, 2, 1.0)
    assert first.rejoin_round("1", 3) == 3
    assert second.rejoin_round("1", 4) == 3
    assert second.rejoin_round("2", None) is None
    assert first.rejoin_round("2", 5) is None


@pytest.mark.timeout(30)
def test_the_members_restore_a_snapshot_all_of_them_hold() -> None:
    store = MemoryStore()
    a, b = Rounds(store, JOB, 0, 2, 30.0), Rounds(store, JOB, 0, 2, 30.0)
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(a.held_by_all("1", 0, 2, [12, 13])))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waits for its peer
    assert b.held_by_all("1", 1, 2, [11, 12]) == [12]
    t.join()
    assert got == [[12]]


def _alone(store: MemoryStore, rounds: int) -> Rounds:
    """Group 0 of 2 publishes round 0 and then does ``rounds`` rounds alone (group 1
    has not started: it is not expected), pruning as the writer does."""
    a = Rounds(store, JOB, 0, 2, 30.0)
    a.publish(0, b"g0")
    a.announce("0", 0)
    for r in range(1, rounds + 1):
        a.contribute(r, b"x")
        assert a.agree(r) == [0]
        assert a.publish(r, b"g%d" % r)
        a.prune(r)
    return a


@pytest.mark.timeout(30)
def test_a_group_starting_late_starts_from_the_newest_round_at_once() -> None:
    """Group 0 went on alone for 3 rounds before group 1 started (the job of 10 tiny
    steps that once took 365 s: round 0 was pruned at round 2 and group 1 waited the
    hang ceiling for it). Group 1 starts from the newest round without waiting (its
    wait is 0.2 s: over it, it raises), and its members agree on that round."""
    store = MemoryStore()
    a = _alone(store, 3)
    b, b2 = Rounds(store, JOB, 1, 2, 0.2), Rounds(store, JOB, 1, 2, 0.2)
    assert b.start_round("0", 0.2) == 3
    assert b.global_state(3) == b"g3"
    a.contribute(4, b"x")
    a.agree(4)
    a.publish(4, b"g4")
    assert b2.start_round("0", 0.2) == 3  # its peer, reading after round 4: the same round
    assert b.start_round("1", 0.2) == 4  # (a later life decides anew)


@pytest.mark.timeout(30)
def test_round_0_is_kept_and_a_group_on_time_starts_from_it() -> None:
    store = MemoryStore()
    b = Rounds(store, JOB, 1, 2, 30.0)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(b.start_round("0", 30.0)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waits for group 0's initial parameters
    a = Rounds(store, JOB, 0, 2, 30.0)
    a.publish(0, b"g0")
    t.join()
    assert got == [0]
    for r in (1, 2, 3, 4):  # pruning never takes round 0 (a first life's start)
        a.contribute(r, b"x")
        a.agree(r)
        a.publish(r, b"g%d" % r)
        a.prune(r)
    assert a.global_state(0) == b"g0"
    with pytest.raises(RoundError, match="never published"):
        a.global_state(2)


def test_a_group_whose_round_0_never_comes_is_an_error() -> None:
    with pytest.raises(RoundError, match="group 0's initial parameters"):
        Rounds(MemoryStore(), JOB, 1, 2, 0.1).start_round("0", 0.1)
