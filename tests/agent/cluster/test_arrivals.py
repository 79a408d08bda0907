"""A node's workers arrive at an agreement through their agent (agent/cluster/_arrivals.py)
with the worker's real ``agree`` (runtime/rejoin/_rendezvous.py) and its end of the relay
(runtime/rejoin/_arrivals.py): one transaction and one watch per node, the same
agreement as without the relay, and the store asked directly whenever the relay cannot
answer (a worker out of format, a relay that ends mid-wait)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from _load import wait_until

from stalwart.agent.cluster._arrivals import ArrivalRelay
from stalwart.coordinator import Compare, Coordinator, CoordinatorConfig, MemoryStore, Put
from stalwart.coordinator.arrivals import Await
from stalwart.runtime.rejoin._arrivals import BROKEN, RelayedArrivals
from stalwart.runtime.rejoin._rendezvous import Agreement, agree

ROOT = "/stalwart/j/"


class _Counting(MemoryStore):
    """Counts transactions and watches opened, by who asked (a thread name prefix)."""

    def __init__(self) -> None:
        super().__init__()
        self.txns: dict[str, int] = {}
        self.watches: dict[str, int] = {}
        self._counts = threading.Lock()  # (MemoryStore's own is _lock)

    def _count(self, what: dict[str, int]) -> None:
        who = threading.current_thread().name.replace("_", "-").split("-")[0]
        with self._counts:
            what[who] = what.get(who, 0) + 1

    def txn(self, *args: Any, **kwargs: Any) -> Any:
        self._count(self.txns)
        return super().txn(*args, **kwargs)

    def watch(self, prefix: str, start_revision: int | None = None) -> Any:
        self._count(self.watches)
        return super().watch(prefix, start_revision)


def _member(
    store: MemoryStore,
    coord: Coordinator,
    rank: int,
    n: int,
    held: dict[str, Any],
    gen_min: int,
    relay: RelayedArrivals | None,
) -> Agreement:
    """One worker's ``agree``: ``held``, its snapshot steps and last step done."""
    info = {**held, "rank": rank}
    return agree(
        store,
        coord,
        "j",
        rank,
        n,
        info,
        use_memory=True,
        disk_step=None,
        min_generation=gen_min,
        timeout_s=60.0,
        relay=relay,
    )


def _agree_nodes(
    store: MemoryStore, relays: list[ArrivalRelay | None], per: int, gen_min: int = 1
) -> list[Agreement]:
    """``len(relays)`` nodes of ``per`` workers each agree; rank 0 (node 0's first) last."""
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    coord.advance_generation(0, "a node was lost")  # the job is at gen_min already
    n = len(relays) * per
    clients = [
        None if (relay := relays[r // per]) is None else RelayedArrivals(relay.address, per)
        for r in range(n)
    ]

    def join(rank: int) -> Agreement:
        return _member(store, coord, rank, n, {"steps": [3, 4], "done": 4}, gen_min, clients[rank])

    try:
        with ThreadPoolExecutor(n, thread_name_prefix="worker") as pool:
            futures = [pool.submit(join, r) for r in range(n - 1, -1, -1)]
            return [f.result() for f in futures]
    finally:
        for c in clients:
            if c is not None:
                c.close()


def test_a_nodes_workers_arrive_in_one_transaction_and_share_one_watch() -> None:
    store = _Counting()
    # no linger cut short by a loaded host: each node writes once its 4 are in
    relays = [ArrivalRelay(store, ROOT, linger_s=60.0) for _ in range(3)]
    try:
        agreed = _agree_nodes(store, list(relays), per=4)
    finally:
        for r in relays:
            r.close()
    assert {(a.generation, a.target, a.tier) for a in agreed} == {(1, 4, "memory")}
    assert len(store.range("/stalwart/j/rt/").kvs) == 12  # every worker's own arrival
    # every arrival went through its node's agent, one transaction a node (node 0: two,
    # rank 0's arrival is guarded apart: it publishes the agreement, it never awaits it)
    assert store.txns.get("worker", 0) == 1  # rank 0's agreement, its own
    assert [r.arrivals for r in relays] == [4, 4, 4]
    assert [r.transactions for r in relays] == [2, 1, 1]
    # each node's waiting workers (rank 0 gathers instead) share one watch
    assert [r.watches for r in relays] == [1, 1, 1]
    assert "stalwart" in store.watches and store.watches["stalwart"] == 3


def test_a_worker_that_never_arrives_delays_its_nodes_others_by_the_linger_only() -> None:
    store = MemoryStore()
    relay = ArrivalRelay(store, ROOT, linger_s=0.2)
    clients = [RelayedArrivals(relay.address, peers=4) for _ in range(3)]  # of 4
    try:
        guard = [Compare(f"{ROOT}gen", "mod_revision", "==", 0)]

        def arrive(i: int) -> Any:
            return clients[i].arrive(guard, Put(f"{ROOT}rt/000000000000.0/{i:06d}", b"{}"), 30)

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(arrive, range(3)))
        assert [g.succeeded for g in got] == [True, True, True]
        assert len(store.range(f"{ROOT}rt/").kvs) == 3
    finally:
        for c in clients:
            c.close()
        relay.close()


def test_the_same_agreement_with_and_without_the_relay() -> None:
    with_relay, without = _Counting(), _Counting()
    relays = [ArrivalRelay(with_relay, ROOT) for _ in range(2)]
    try:
        a = _agree_nodes(with_relay, list(relays), per=3)
    finally:
        for r in relays:
            r.close()
    b = _agree_nodes(without, [None, None], per=3)
    key = lambda x: (x.generation, x.target, x.tier, x.last_done, x.members)  # noqa: E731
    assert sorted(map(key, a)) == sorted(map(key, b))
    assert without.txns["worker"] == 7  # 6 arrivals and the agreement, each its own


def test_a_moved_generation_refuses_the_nodes_arrivals_and_nothing_is_written() -> None:
    store = MemoryStore()
    relay = ArrivalRelay(store, ROOT)
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    coord.advance_generation(0, "a test")  # the job is at 1; these arrive at 0
    clients = [RelayedArrivals(relay.address) for _ in range(3)]
    try:
        guard = [coord.generation_is(0)]

        def arrive(i: int) -> Any:
            return clients[i].arrive(guard, Put(f"{ROOT}rt/000000000000.0/{i:06d}", b"{}"), 10)

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(arrive, range(3)))
        assert [g.succeeded for g in got] == [False, False, False]
        assert store.range(f"{ROOT}rt/").kvs == []
    finally:
        for c in clients:
            c.close()
        relay.close()


def test_waiters_get_the_agreement_or_the_end_and_a_late_one_gets_it_at_once() -> None:
    store = MemoryStore()
    relay = ArrivalRelay(store, ROOT)
    key, end = f"{ROOT}agreed/000000000003.0", f"{ROOT}agreed/000000000003.end"
    start = store.put(f"{ROOT}x", b"1") + 1
    req = Await(f"{ROOT}agreed/000000000003.", key, end, start)
    early = [RelayedArrivals(relay.address) for _ in range(4)]
    try:
        assert all(c.ask_await(req) for c in early)
        assert all(c.reply(0.05) is None for c in early)  # nothing yet: still waiting
        store.put(key, b'{"target": 4}')
        assert {c.reply(10).record for c in early} == {b'{"target": 4}'}  # type: ignore[union-attr]
        late = RelayedArrivals(relay.address)
        assert late.ask_await(req)
        assert late.reply(10).record == b'{"target": 4}'  # type: ignore[union-attr]
        assert relay.watches == 1
        # another generation ends before its agreement: the waiters hear the end
        key4, end4 = f"{ROOT}agreed/000000000004.0", f"{ROOT}agreed/000000000004.end"
        req4 = Await(f"{ROOT}agreed/000000000004.", key4, end4, store.put(f"{ROOT}x", b"2") + 1)
        assert early[0].ask_await(req4)
        store.put(end4, b"")
        assert early[0].reply(10).end  # type: ignore[union-attr]
        late.close()
    finally:
        for c in early:
            c.close()
        relay.close()


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b'{"v": 2, "op": "arrive"}\n',
        b'{"v": 1, "op": "arrive", "key": "/stalwart/other/rt/1", "value": "{}", "guard": []}\n',
        b'{"v": 1, "op": "arrive", "key": "/stalwart/j/members/node0", "value": "", "guard": []}\n',
        b'{"v": 1, "op": "await", "prefix": "/stalwart/j/rt/", "key": "/stalwart/j/rt/1",'
        b' "end": "/stalwart/j/agreed/e", "start": 1}\n',
    ],
)
def test_a_worker_out_of_format_is_hung_up_on_and_the_others_are_served(line: bytes) -> None:
    store = MemoryStore()
    relay = ArrivalRelay(store, ROOT)
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    good = RelayedArrivals(relay.address)
    try:
        bad.settimeout(10)
        bad.connect("\0" + relay.address[1:])
        bad.sendall(line)
        assert bad.recv(100) == b""  # hung up on, nothing answered, nothing written
        put = Put(f"{ROOT}rt/000000000000.0/000001", b"{}")
        done = good.arrive([Compare(f"{ROOT}gen", "mod_revision", "==", 0)], put, 10)
        assert done is not None and done.succeeded
        assert [kv.key for kv in store.range(ROOT).kvs] == [put.key]
    finally:
        bad.close()
        good.close()
        relay.close()


def test_a_relay_that_ends_mid_wait_leaves_the_workers_on_the_store() -> None:
    """The agent's relay closes while its workers wait for rank 0: they wait on the store
    themselves and agree all the same."""
    store = MemoryStore()
    relay = ArrivalRelay(store, ROOT)
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    clients = [RelayedArrivals(relay.address) for _ in range(3)]

    held = {"steps": [5], "done": 5}
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(_member, store, coord, r, 4, held, 1, clients[r - 1]) for r in (1, 2, 3)
            ]
            assert wait_until(lambda: len(store.range(f"{ROOT}rt/").kvs) == 3, 30)
            relay.close()  # mid-wait: their relay ends
            own = _member(store, coord, 0, 4, held, 1, None)
            got = [f.result(timeout=60) for f in futures]
        assert {(a.generation, a.target) for a in [own, *got]} == {(1, 5)}
    finally:
        for c in clients:
            c.close()


def test_no_relay_there_means_the_store() -> None:
    client = RelayedArrivals("@stalwart-arr-000000000000000000000000")
    put = Put(f"{ROOT}rt/000000000000.0/000001", b"{}")
    assert client.arrive([], put, 1) is None
    assert not client.ask_await(Await(f"{ROOT}agreed/0.", f"{ROOT}agreed/0.0", "e", 1))
    assert client.reply(0.1) is BROKEN


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
    reason="needs root and a system python to run a process as another user",
)
def test_a_process_of_another_user_is_not_served() -> None:
    """An abstract socket's name is listed in /proc/net/unix for anyone on the host, and
    what the relay writes goes in with the node's lease: another user is hung up on."""
    store = MemoryStore()
    relay = ArrivalRelay(store, ROOT)
    line = (
        b'{"v":1,"op":"arrive","key":"/stalwart/j/rt/000000000000.0/000001","value":"{}",'
        b'"guard":[],"peers":1}\n'
    )
    script = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.settimeout(20)\n"
        "s.connect('\\0' + sys.argv[1])\n"
        "try:\n"
        "    s.sendall(sys.stdin.buffer.read())\n"
        "    got = s.recv(100)\n"
        "except OSError:\n"
        "    got = b''\n"
        "sys.stdout.write(repr(got))\n"
    )
    try:
        done = subprocess.run(
            ["/usr/bin/python3", "-c", script, relay.address[1:]],  # (the venv's: not theirs)
            input=line,
            capture_output=True,
            timeout=60,
            user=65534,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == b"b''"  # hung up on, nothing answered
        assert store.range(ROOT).kvs == []  # nothing written
    finally:
        relay.close()
