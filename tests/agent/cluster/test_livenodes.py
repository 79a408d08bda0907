"""agent/cluster/_livenodes.py and _digest.py: one writer follows the membership and writes
it as ranges into one key; every other agent follows that key. A join of N nodes costs a
reader a few events, not one per node (N^2/2 for the job before, issue 31)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from _load import wait_until

from stalwart.agent.cluster._digest import encode_digest, parse_digest
from stalwart.agent.cluster._follow import Followed
from stalwart.agent.cluster._livenodes import LiveNodes, _left
from stalwart.coordinator import MemoryStore

from ._helpers import CountingStore

ROOT = "/stalwart/j"


class _Job:
    """Members with a lease each, in one MemoryStore, as agents join (coordinator/membership.py)."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.leases: dict[int, int] = {}
        self.views: list[LiveNodes] = []

    def join(self, node: int) -> None:
        lease = self.leases[node] = self.store.grant(60)
        self.store.put(f"{ROOT}/members/node{node}", b"{}", lease)
        self.store.put(f"{ROOT}/joined/node{node}", b"host")

    def view(self, node: int, *, claims: bool, store: object = None) -> LiveNodes:
        view = LiveNodes(
            store or self.store,
            ROOT,
            node,
            claims=claims,
            lease=lambda: self.leases.get(node),
            wait_s=5.0,
        )
        self.views.append(view)
        return view

    def close(self) -> None:
        for view in self.views:
            view.close()


@pytest.fixture
def job() -> Iterator[_Job]:
    job = _Job()
    try:
        yield job
    finally:
        job.close()


def _writes(view: LiveNodes, timeout: float = 10) -> bool:
    def claimed() -> bool:
        view.tick()
        return view.writing

    return wait_until(claimed, timeout)


def test_a_join_of_many_nodes_costs_a_reader_a_few_events_not_one_per_node(job: _Job) -> None:
    job.join(0)
    writer = job.view(0, claims=True)
    assert _writes(writer)
    counting = CountingStore(job.store)
    reader = job.view(7, claims=False, store=counting)
    assert wait_until(lambda: reader.nodes() == {0}, 10)
    for n in range(1, 300):  # 299 joins in a burst
        job.join(n)
    assert wait_until(lambda: reader.nodes() == set(range(300)), 20)
    assert reader.left() == set()
    # the digest moved a few times (once per writer batch), each one event to the reader;
    # following the members themselves it would have been 299 events
    assert counting.events <= 20, counting.events
    requests = counting.requests
    for _ in range(100):
        assert len(reader.nodes()) == 300  # a look costs no request
    assert counting.requests == requests


def test_a_lost_node_leaves_the_live_set_and_enters_left(job: _Job) -> None:
    for n in range(5):
        job.join(n)
    writer = job.view(0, claims=True)
    assert _writes(writer)
    reader = job.view(3, claims=False)
    assert wait_until(lambda: reader.nodes() == {0, 1, 2, 3, 4}, 10)
    job.store.revoke(job.leases[2])  # node 2's lease ends: its member key goes
    assert wait_until(lambda: reader.nodes() == {0, 1, 3, 4} and reader.left() == {2}, 10)
    assert writer.nodes() == {0, 1, 3, 4} and writer.left() == {2}
    assert reader.read_nodes() == {0, 1, 3, 4}


def test_when_the_writer_is_lost_another_claims_and_the_old_one_cannot_write(
    job: _Job,
) -> None:
    for n in range(4):
        job.join(n)
    first, second = job.view(0, claims=True), job.view(1, claims=True)
    assert _writes(first)
    second.tick()
    assert not second.writing  # the part is taken: one writer
    job.store.revoke(job.leases[0])  # the writer's lease ends (its writer key with it)
    assert _writes(second)
    assert wait_until(lambda: second.nodes() == {1, 2, 3} and second.left() == {0}, 10)
    # the old writer still follows the members: its next write is refused, never stored
    job.join(4)
    assert wait_until(lambda: not (first.tick() or first.writing), 10)
    raw = job.store.get(f"{ROOT}/live/digest")
    assert raw is not None
    digest = parse_digest(raw.value)
    assert digest is not None and digest.by == 1


def test_a_reader_without_a_digest_reads_the_members(job: _Job) -> None:
    job.join(0)
    job.join(5)
    reader = job.view(5, claims=False)  # nobody writes
    assert reader.nodes() == {0, 5}
    job.store.revoke(job.leases[0])
    assert reader.nodes() == {5} and reader.left() == {0}  # from the store, never stale


def test_a_digest_without_a_writer_is_not_believed(job: _Job) -> None:
    job.join(0)
    job.store.put(f"{ROOT}/live/digest", encode_digest(9, {0, 1, 2}, set()))  # stale, no writer
    reader = job.view(0, claims=False)
    assert wait_until(lambda: reader.nodes() == {0}, 10)


def test_the_digest_is_ranges_and_equal_sets_give_equal_bytes() -> None:
    raw = encode_digest(3, [5, 0, 1, 2, 9, 10], [4])
    assert json.loads(raw) == {"v": 1, "by": 3, "live": [[0, 2], [5, 5], [9, 10]], "left": [[4, 4]]}
    assert raw == encode_digest(3, {10, 9, 5, 2, 1, 0}, {4})
    digest = parse_digest(raw)
    assert digest is not None
    assert digest.live == {0, 1, 2, 5, 9, 10} and digest.left == {4} and digest.by == 3
    big = parse_digest(encode_digest(0, range(100_000), []))
    assert big is not None and len(big.live) == 100_000
    assert len(encode_digest(0, range(100_000), [])) < 64


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b"not json",
        b'{"v": 2, "by": 0, "live": [], "left": []}',
        b'{"v": 1, "by": -1, "live": [], "left": []}',
        b'{"v": 1, "by": true, "live": [], "left": []}',
        b'{"v": 1, "by": 0, "live": [[2, 1]], "left": []}',  # a backwards range
        b'{"v": 1, "by": 0, "live": [[0, 3], [2, 5]], "left": []}',  # overlapping
        b'{"v": 1, "by": 0, "live": [[3, 4], [0, 1]], "left": []}',  # out of order
        b'{"v": 1, "by": 0, "live": [[0, 1.5]], "left": []}',
        b'{"v": 1, "by": 0, "live": [[0, 2147483648]], "left": []}',  # past 2^31 - 1
        b'{"v": 1, "by": 0, "live": [[0, 2147483647]], "left": []}',  # 2^31 ids: too many
        b'{"v": 1, "by": 0, "live": [[0, 1]], "left": [[1, 1]]}',  # live and left at once
        b'{"v": 1, "by": 0, "live": [[0, NaN]], "left": []}',
        b'{"v": 1, "by": 0, "live": [], "left": [], "x": 1}',
        b'{"v": 1, "by": 0, "live": [[0]], "left": []}',
    ],
)
def test_a_malformed_digest_is_refused_never_raised(raw: bytes) -> None:
    assert parse_digest(raw) is None


def test_a_claim_whose_answer_was_lost_is_taken_up_not_left_vacant(job: _Job) -> None:
    """The claim's transaction went through but its answer never came (a timeout under
    load): the key is ours, so nobody else claims; we must write, or no one ever does."""
    job.join(0)
    job.join(1)
    writer = f"{ROOT}/live/writer"
    job.store.put(writer, f"0 {job.leases[0]}".encode(), job.leases[0])
    view = job.view(0, claims=True)
    assert _writes(view)
    assert wait_until(lambda: job.store.get(f"{ROOT}/live/digest") is not None, 10)
    other = job.view(1, claims=False)
    assert wait_until(lambda: other.nodes() == {0, 1} and other._current() is not None, 10)


def test_a_node_the_members_watch_has_not_carried_yet_is_not_counted_left() -> None:
    """The writer's two watches go at their own pace: node 1's ``joined`` key (revision 12)
    is newer than the members' snapshot (revision 10), so its member key may simply not
    have arrived; node 2 joined at 8 and has no member key as of 10: it left."""
    joined = Followed(
        {"node0": b"h", "node1": b"h", "node2": b"h"},
        {"node0": 3, "node1": 12, "node2": 8},
        12,
    )
    assert _left(frozenset({0}), 10, joined) == {2}
    assert _left(frozenset({0}), 12, joined) == {1, 2}  # the members' watch caught up
