"""A watched data plane: the stall rule, the probe, and which side of a cut is fenced.

In-process: the decisions are pure (agent/detection/dataplane.py), the probe meets a real peer
watch listener on loopback, and the agent's side (agent/detection/_dataplane_watch.py) acts on an
in-memory store with a probe the test answers.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _load import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.agent import Activity, HangConfig, decide, find_stall
from stalwart.agent.cluster._cluster import ring_successor
from stalwart.agent.cluster._fencing import NodeFenced, NodeLease
from stalwart.agent.cluster._peerwatch import PeerWatch
from stalwart.agent.detection._dataplane_watch import DataPlaneWatch, probe
from stalwart.contract.board import Slot
from stalwart.coordinator import MemoryStore

CFG = HangConfig(floor_s=1.0, k=3.0, idle_s=60.0, ceiling_s=300.0)
NOW = 1000.0
ROOT = "/stalwart/job"


def slot(phase: str, t_progress: float, *, attached: bool = True) -> Slot:
    return Slot(1, 10, phase, 0, t_progress, NOW, 0.1, attached, not attached)


def idle(since: float) -> Activity:
    return Activity("S", t_busy=since)


# ---------------------------------------------------------------- the stall rule
def test_every_local_rank_waiting_in_a_collective_past_the_bound_is_a_stall() -> None:
    slots = {2: slot("collective", NOW - 5), 3: slot("collective", NOW - 5)}
    stall = find_stall(slots, NOW, CFG, {2: idle(NOW - 5), 3: idle(NOW - 5)})
    assert stall is not None
    assert stall.ranks == [2, 3]
    assert stall.threshold_s == CFG.floor_s
    assert stall.stalled_s > stall.threshold_s


def test_a_waiting_ranks_cpu_does_not_hide_a_stall() -> None:
    """Ranks blocked in a cut collective show CPU blips (a thread of theirs): measured
    across two hosts, every 1.5-2.5 s, which hid the stall on most loop turns and put
    the probes 5 s apart (a permanent partition found 11-12 s in). The probe decides,
    so a rank's CPU in a collective does not keep the agent from asking."""
    slots = {2: slot("collective", NOW - 5), 3: slot("collective", NOW - 5)}
    stall = find_stall(slots, NOW, CFG, {2: Activity("R", NOW), 3: idle(NOW - 0.2)})
    assert stall is not None and stall.stalled_s == 5


def test_no_stall_while_within_the_bound_or_someone_steps() -> None:
    waiting = {2: slot("collective", NOW - 5), 3: slot("collective", NOW - 5)}
    quiet = {2: idle(NOW - 5), 3: idle(NOW - 5)}
    stepping = {2: slot("collective", NOW - 5), 3: slot("step", NOW - 5)}
    assert find_stall(stepping, NOW, CFG, quiet) is None  # rank 3 computes its step
    recent = {2: slot("collective", NOW - 5), 3: slot("collective", NOW - 0.5)}
    assert find_stall(recent, NOW, CFG, quiet) is None  # rank 3 just moved
    assert find_stall(waiting, NOW, CFG, quiet, since=NOW - 0.5) is None  # a recovery began


def test_a_plain_script_or_an_unsampled_rank_is_no_stall() -> None:
    plain = {2: slot("collective", NOW - 50, attached=False)}
    assert find_stall(plain, NOW, CFG, {2: idle(NOW - 50)}) is None
    assert find_stall({2: slot("collective", NOW - 50)}, NOW, CFG, {}) is None


# ---------------------------------------------------------------- which side is fenced
def test_two_nodes_cut_apart_rank_0s_node_wins_the_tie() -> None:
    zero = decide(0, {0, 1}, set(), holder=0)
    one = decide(1, {0, 1}, set(), holder=0)
    assert zero is not None and zero.fence == (1,) and not zero.fence_self
    assert one is not None and one.fence_self and one.fence == ()
    # rank 0 adopted by node 1 earlier: the tie goes the other way
    zero = decide(0, {0, 1}, set(), holder=1)
    one = decide(1, {0, 1}, set(), holder=1)
    assert zero is not None and zero.fence_self
    assert one is not None and one.fence == (0,)


def test_the_minority_fences_itself_and_only_rank_0s_node_fences_others() -> None:
    live = {0, 1, 2}
    cut2 = [decide(n, live, reach, holder=0) for n, reach in ((0, {1}), (1, {0}), (2, set()))]
    assert [(c.fence_self, c.fence) for c in cut2 if c] == [(False, (2,)), (False, ()), (True, ())]
    # rank 0's node is the one cut off: it fences itself, nobody fences it
    cut0 = [decide(n, live, reach, holder=0) for n, reach in ((0, set()), (1, {2}), (2, {1}))]
    assert [(c.fence_self, c.fence) for c in cut0 if c] == [(True, ()), (False, ()), (False, ())]


def test_every_peer_answered_is_no_cut() -> None:
    assert decide(1, {0, 1, 2}, {0, 2}, holder=0) is None
    assert decide(0, {0}, set(), holder=0) is None  # alone: nothing to be cut from


_groups = st.lists(st.integers(0, 3), min_size=2, max_size=7)  # node -> its side


@settings(max_examples=200, deadline=None)
@given(_groups, st.data())
def test_a_clean_partition_leaves_exactly_the_winning_side(sides: list[int], data: Any) -> None:
    """Each node reaches exactly its own side: the winners are the strict majority side,
    else the side of rank 0's node when it holds exactly half; every other node is
    fenced (by itself, or by rank 0's node), and no winner is."""
    live = set(range(len(sides)))
    holder = data.draw(st.sampled_from(sorted(live)))
    side_of = {n: {m for m in live if sides[m] == sides[n]} for n in live}
    cuts = {n: decide(n, live, side_of[n] - {n}, holder) for n in live}
    fenced = {n for n, c in cuts.items() if c and c.fence_self}
    fenced |= {m for c in cuts.values() if c for m in c.fence}
    big = [s for s in map(frozenset, side_of.values()) if 2 * len(s) > len(live)]
    tie = 2 * len(side_of[holder]) == len(live)
    winners = set(big[0]) if big else side_of[holder] if tie else set()
    assert fenced == live - winners
    for n, c in cuts.items():
        assert c is None or not c.fence or n == holder  # only rank 0's node fences others


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.data())
def test_any_reachability_never_has_rank_0s_node_fenced_by_another(n: int, data: Any) -> None:
    """Links that are not transitive (A-B, B-C, not A-C): whatever each node reached,
    only rank 0's node revokes others' leases, so two sides never fence each other."""
    live = set(range(n))
    reach = {a: set(data.draw(st.sets(st.sampled_from(sorted(live - {a}))))) for a in live}
    cuts = [decide(a, live, reach[a], holder=0) for a in live]
    assert all(0 not in c.fence for c in cuts if c)
    assert all(not c.fence for a, c in zip(sorted(live), cuts, strict=True) if c and a != 0)


# ---------------------------------------------------------------- the probe
def test_the_probe_answers_for_a_live_watch_listener_and_never_counts_as_a_watch() -> None:
    store = MemoryStore()
    lease = store.grant(30.0)
    store.put(f"{ROOT}/members/node0", b"{}", lease)
    store.put(f"{ROOT}/members/node1", b"{}", store.grant(30.0))
    watch = PeerWatch(store, ROOT, 0, b"t" * 32, "127.0.0.1", lambda: {0, 1}, ring_successor)
    try:
        assert probe(watch.address)
        assert probe(watch.address)
        assert watch.closed_at == {}  # a probe is no watched connection that ended
        assert store.get(f"{ROOT}/members/node1") is not None
    finally:
        watch.close()
    with socket.socket() as spare:  # a port nobody listens on: refused
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]
    assert not probe(f"127.0.0.1:{port}", timeout=1.0)
    assert not probe("not-an-address")


def test_a_probe_answered_on_one_connection_of_several_is_answered() -> None:
    """A lossy link loses some connections of a probe, not all: a listener that answers
    only one connection in four (the others close unanswered, as a lost SYN or nonce
    leaves them) still answers the probe; a lone connection would not have been."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        served: list[int] = []

        def serve(n: int) -> None:
            for i in range(n):
                conn, _ = srv.accept()
                with conn:
                    if i % 4 == 3:
                        conn.sendall(b"n" * 16)
                served.append(i)

        t = threading.Thread(target=serve, args=(5,), daemon=True)
        t.start()
        assert not probe(address, attempts=1)  # the first connection: closed unanswered
        assert probe(address, attempts=4)  # one of the four gets its nonce
        t.join(timeout=scaled(10))
        assert served == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- the agent's side
class _Worker:
    pid = 4242


class _Workers:
    def __init__(self, ranks: list[int], *, stalled_s: float = 30.0, p99: float = 0.1) -> None:
        t = time.time() - stalled_s
        self.slots = {r: Slot(1, 10, "collective", 0, t, t, p99, True, False) for r in ranks}

    def judged(self) -> dict[int, Slot]:
        return self.slots

    def __getitem__(self, rank: int) -> _Worker:
        return _Worker()


class _Watch:
    def __init__(self, blip_every: float = 0.0) -> None:
        self.blip_every = blip_every  # > 0: the ranks' CPU moves once per this many seconds

    def sample(self, pids: dict[int, int], now: float, slowed: frozenset[int]) -> dict[int, Any]:
        if self.blip_every:
            return {r: idle(now - now % self.blip_every) for r in pids}
        return {r: idle(now - 60) for r in pids}


class _Events:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.records.append((kind, fields))


def _job(store: MemoryStore) -> dict[int, int]:
    leases = {}
    for n in (0, 1):
        leases[n] = store.grant(30.0)
        store.put(f"{ROOT}/members/node{n}", b"{}", leases[n])
        store.put(f"{ROOT}/ranks/node{n}", json.dumps([2 * n, 2 * n + 1]).encode())
        store.put(f"{ROOT}/launch/watch-node{n}", f"127.0.0.1:{40000 + n}".encode())
    return leases


def _watch(
    store: MemoryStore,
    node: int,
    lines: list[str],
    events: _Events,
    lease: NodeLease,
    *,
    lease_s: float = 3.0,
    probe_peer: Callable[[str], bool] = lambda address: False,  # the data plane is cut
    grace_s: float = 0.0,
    workers: Any = None,
    blip_every: float = 0.0,
) -> DataPlaneWatch:
    key = f"{ROOT}/members/node{node}"
    kv = store.get(key)
    assert kv is not None
    lease.joined(key, kv.create_revision)
    workers = workers or _Workers([2 * node, 2 * node + 1])
    watch: Any = _Watch(blip_every)
    return DataPlaneWatch(
        config=CFG,
        node=node,
        store=store,
        root=ROOT,
        live=lambda: {0, 1},
        lease=lease,
        lease_s=lease_s,
        workers=workers,
        watch=watch,
        events=events,
        say=lines.append,
        probe_peer=probe_peer,
        grace_s=grace_s,
    )


def _until(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := check()) is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("no decision before the deadline")


def test_rank_0s_node_revokes_the_cut_peers_lease_and_says_why() -> None:
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    dp = _watch(store, 0, lines, events, NodeLease(0))
    cut = _until(lambda: dp.check(time.time(), frozenset()))
    assert cut.fence == (1,)
    assert store.get(f"{ROOT}/members/node1") is None  # lease revoked: node 1 is lost
    assert store.get(f"{ROOT}/members/node0") is not None
    record = store.get(f"{ROOT}/launch/cut-node1")
    assert record is not None and "data plane cut" in json.loads(record.value)["how"]
    assert any("data plane cut" in line for line in lines)
    assert [k for k, _ in events.records] == ["note"]


def test_the_cut_off_node_fences_itself() -> None:
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    lease = NodeLease(1)
    dp = _watch(store, 1, lines, events, lease)
    with pytest.raises(NodeFenced, match="fences itself"):  # the agent exits 3
        _until(lambda: dp.check(time.time(), frozenset()))
    assert store.get(f"{ROOT}/members/node1") is None  # its own lease: fenced, exit 3
    assert store.get(f"{ROOT}/members/node0") is not None
    assert lease.lost_reason is not None and "fences itself" in lease.lost_reason


def test_a_silent_peer_whose_lease_may_still_expire_is_not_a_cut_yet() -> None:
    """Node 0's machine lost power: node 1's probe fails as in a cut, but node 0's lease
    expires within the TTL and node 1 adopts its ranks. So node 1 fences itself only once
    the stall outlived the lease with node 0 still a live member: not before."""
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    probes: list[str] = []
    lease = NodeLease(1)
    dp = _watch(
        store, 1, lines, events, lease, lease_s=600.0,
        probe_peer=lambda address: probes.append(address) is not None,  # (False)
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(probes) < 3:  # the decision came back twice and was postponed
        assert time.monotonic() < deadline, "the probe never ran again"
        assert dp.check(time.time(), frozenset()) is None
        time.sleep(0.01)
    assert store.get(f"{ROOT}/members/node1") is not None
    assert lease.lost_reason is None


def test_no_cut_is_decided_while_the_stall_is_within_the_partition_grace() -> None:
    """A partition shorter than the grace (agent/cluster/_grace.py) heals into the same
    generation: rank 0's node probes, finds the peer cut, and waits (probing again)."""
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    probes: list[str] = []
    dp = _watch(
        store, 0, lines, events, NodeLease(0), grace_s=600.0,
        probe_peer=lambda address: probes.append(address) is not None,  # (False)
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(probes) < 3:
        assert time.monotonic() < deadline, "the probe never ran again"
        assert dp.check(time.time(), frozenset()) is None
        time.sleep(0.01)
    assert store.get(f"{ROOT}/members/node1") is not None  # nobody revoked
    assert store.get(f"{ROOT}/launch/cut-node1") is None and events.records == []


def test_a_cut_is_found_within_seconds_however_slow_the_steps() -> None:
    """Issue 25: elastic steps at load 35 made the probe wait 3 x p99 (104.8 s before a
    permanent partition was found, silent meanwhile). The probe starts after the hang
    floor whatever the step time: with a p99 step of 30 s, 12 s into the stall, rank 0's
    node has probed and fenced the cut peer."""
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    slow = _Workers([0, 1], stalled_s=12.0, p99=30.0)
    dp = _watch(store, 0, lines, events, NodeLease(0), workers=slow)
    cut = _until(lambda: dp.check(time.time(), frozenset()))
    assert cut.fence == (1,)
    assert store.get(f"{ROOT}/members/node1") is None


def test_one_missed_probe_is_no_cut() -> None:
    """A peer agent starved for a moment misses a probe: a peer is cut only when it
    answered none for UNREACHED_S in a row, so one miss then answers fences nobody."""
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    answers = [False, True, True, True]
    probes: list[str] = []

    def flaky(address: str) -> bool:
        probes.append(address)
        return answers[min(len(probes), len(answers)) - 1]

    dp = _watch(store, 0, lines, events, NodeLease(0), probe_peer=flaky)
    deadline = time.monotonic() + 60
    while len(probes) < 3:  # missed, then answered: the stall goes on, probed every 5 s
        assert time.monotonic() < deadline, "the probe never ran again"
        assert dp.check(time.time(), frozenset()) is None
        time.sleep(0.01)
    assert store.get(f"{ROOT}/members/node1") is not None
    assert store.get(f"{ROOT}/launch/cut-node1") is None and events.records == []


def test_a_long_stall_says_once_what_it_waits_for_and_until_when() -> None:
    """No silent wait over 10 s (issue 25): every peer answers (a remote rank computes a
    long step), so nothing is fenced, and one line names the wait and its end."""
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    probes: list[str] = []
    dp = _watch(
        store, 0, lines, events, NodeLease(0),
        probe_peer=lambda address: probes.append(address) is None,  # (True)
        workers=_Workers([0, 1], stalled_s=12.0),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not probes or not any("every peer agent answers" in line for line in lines):
        assert time.monotonic() < deadline, f"no line after the probe: {lines}"
        assert dp.check(time.time(), frozenset()) is None
        time.sleep(0.01)
    for _ in range(20):
        dp.check(time.time(), frozenset())
    waits = [line for line in lines if "waited" in line]
    assert len(waits) == 1, lines
    assert "in a collective" in waits[0] and "UTC" in waits[0] and "300 s after" in waits[0]
    assert store.get(f"{ROOT}/members/node1") is not None


def test_a_waiting_ranks_cpu_blips_do_not_start_the_probes_over() -> None:
    """Measured across two hosts (elastic, etcd): ranks blocked in the cut collective
    showed a CPU blip every few seconds (a thread of theirs), each ending the stall for a
    moment; when that started the probes over, rank 0's node never had a peer unanswered
    for 2 s in a row and the cut was decided by the other side only, 12.5 s in. The job
    did not move, so the probes go on: here the ranks blip every 1.5 s (the stall is
    seen for 0.5 s of each) and rank 0's node still fences the cut peer."""
    store, lines, events = MemoryStore(), list[str](), _Events()
    _job(store)
    dp = _watch(store, 0, lines, events, NodeLease(0), blip_every=1.5)
    cut = _until(lambda: dp.check(time.time(), frozenset()))
    assert cut.fence == (1,)
    assert store.get(f"{ROOT}/members/node1") is None
