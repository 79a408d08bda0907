from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.runtime.rejoin._rendezvous import Agreement, agree, choose, leaving, members_of


def test_newest_step_every_member_holds() -> None:
    infos: list[dict[str, object]] = [
        {"steps": [8, 9]},  # survivor that finished step 9
        {"steps": [7, 8]},  # replacement reading the dead worker's slots
        {"steps": [8, 9]},
    ]
    assert choose(infos, None, use_memory=True) == (8, "memory")


def test_falls_back_to_disk_then_fresh() -> None:
    infos: list[dict[str, object]] = [{"steps": [8]}, {"steps": []}]
    assert choose(infos, 5, use_memory=True) == (5, "disk")
    assert choose(infos, None, use_memory=True) == (None, "none")
    assert choose([{"steps": [8]}], 5, use_memory=False) == (5, "disk")


def test_ranks_with_their_own_shards_agree_on_a_step_all_of_them_persisted() -> None:
    infos: list[dict[str, object]] = [
        {"steps": [], "disk": [10, 20, 30]},
        {"steps": [], "disk": [10, 20]},  # its persist of step 30 did not finish
    ]
    assert choose(infos, 30, use_memory=True) == (20, "disk")
    assert choose([{"steps": [], "disk": [10]}, {"steps": [], "disk": [20]}], 30, True) == (
        None,
        "none",
    )


def test_a_stale_replica_does_not_block_the_peer_or_disk_tiers() -> None:
    survivors: list[dict[str, object]] = [{"steps": [50, 75], "replicated": True}] * 2
    fresh = {"steps": [75], "replicated": True, "replica": True}
    assert choose([*survivors, fresh], None, True) == (75, "memory")
    stale = {"steps": [25], "replicated": True, "replica": True}
    assert choose([*survivors, stale], None, True) == (75, "peer")
    own = [{"steps": [50, 75], "disk": [25]}] * 2
    assert choose([*own, {"steps": [25], "replica": True, "disk": [25]}], None, True) == (
        25,
        "disk",
    )


def test_a_trained_worker_never_joins_a_fresh_start() -> None:
    import pytest

    from stalwart.errors import CheckpointNotFoundError
    from stalwart.runtime.rejoin._rendezvous import Agreement, no_common_point

    fresh = Agreement(generation=2, target=None, tier="none", last_done=60)
    no_common_point(fresh, 0, rank=2)  # a new process: starting over is right
    no_common_point(Agreement(0, None, "none", 0), 0, rank=0)  # the job's first start
    with pytest.raises(CheckpointNotFoundError, match="trained to step 60"):
        no_common_point(fresh, 60, rank=0)


def test_members_that_trained_are_known_to_leave_a_fresh_start() -> None:
    """A node lost with no common restore point (issue 25's partition cells): the
    survivors trained and exit (no_common_point), the adopted ranks are new. Every member
    reads who leaves from the agreement, so the new ones do not wait the formation
    timeout (60 s) for them."""
    from stalwart.runtime.rejoin._rendezvous import Agreement, leaving

    infos = tuple({"rank": r, "done": d} for r, d in [(0, 64), (1, 64), (2, 0), (3, 0)])
    assert leaving(Agreement(1, None, "none", 64, infos)) == [0, 1]
    assert leaving(Agreement(1, 56, "memory", 64, infos)) == []  # a restore point: all stay
    assert leaving(Agreement(0, None, "none", 0, infos)) == []  # the first start
    fresh = tuple({"rank": r, "done": 0} for r in range(4))
    assert leaving(Agreement(3, None, "none", 64, fresh)) == []  # the replacements


def test_a_restarts_workers_never_count_the_infos_of_killed_ones() -> None:
    """Both workers of the launch before a restart reached generation 1 (and agreed)
    before they were killed; a restarted worker (launch 1) must wait for its own peers,
    not agree with the dead ones' infos."""
    store = MemoryStore()
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    coord.advance_generation(0, "restart after a crash")

    def join(rank: int, launch: int, timeout_s: float) -> Agreement:
        info = {"steps": [8], "done": 9, "rank": rank, "host": "h", "replicated": True}
        return agree(
            store,
            coord,
            "j",
            rank,
            2,
            info,
            use_memory=True,
            disk_step=4,
            min_generation=1,
            timeout_s=timeout_s,
            launch=launch,
        )

    with ThreadPoolExecutor(2) as pool:
        old = [pool.submit(join, r, 0, 30.0) for r in (0, 1)]
        assert [f.result().generation for f in old] == [1, 1]
    with pytest.raises(TimeoutError, match="1 of 2 workers"):
        join(0, 1, 0.3)


def test_an_agreement_costs_each_member_but_rank_0_one_event() -> None:
    """Issue 31: rank 0 gathers the arrivals and publishes the agreement as one key; the
    others watch that key. Every member counting every arrival from a watch received N
    events each, O(N^2) for the job."""
    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    n = 12
    stores = [_RangeCounting(shared) for _ in range(n)]

    def join(rank: int) -> Agreement:
        info = {"steps": [3, 4], "done": 4 - rank % 2, "rank": rank}
        return agree(
            stores[rank],  # type: ignore[arg-type]
            coord,
            "j",
            rank,
            n,
            info,
            use_memory=True,
            disk_step=None,
            min_generation=1,
            timeout_s=60.0,
        )

    with ThreadPoolExecutor(n) as pool:  # rank 0 last: the others wait for it
        futures = [pool.submit(join, r) for r in range(n - 1, -1, -1)]
        agreed = [f.result() for f in futures]
    assert {(a.generation, a.target, a.tier, a.last_done) for a in agreed} == {(1, 4, "memory", 4)}
    assert {len(a.everyone()) for a in agreed} == {n}
    assert max(s.events for s in stores[1:]) <= 1


class _RangeCounting:
    """A member's store: counts the reads of every arrival (ranges) it makes, and the
    watch events it receives."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner, self.ranges, self.events = inner, 0, 0

    def range(self, prefix: str) -> Any:
        self.ranges += 1
        return self.inner.range(prefix)

    def watch(self, prefix: str, start: int | None = None) -> Any:
        return _EventCounting(self, self.inner.watch(prefix, start))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_members_wait_for_each_other_without_reading_every_arrival_again() -> None:
    """Issue 31: a member waiting for the others reads the arrivals twice (before its
    watch, and once all are in), not every few ms: N members polling N keys were
    O(N^2) reads per poll period."""
    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    n = 12
    stores = [_RangeCounting(shared) for _ in range(n)]

    def join(rank: int) -> Agreement:
        info = {"steps": [3], "done": 3, "rank": rank}
        return agree(
            stores[rank],  # type: ignore[arg-type]
            coord,
            "j",
            rank,
            n,
            info,
            use_memory=True,
            disk_step=None,
            min_generation=0,
            timeout_s=60.0,
        )

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(join, r) for r in range(n)]
        agreed = [f.result() for f in futures]
    assert {(a.generation, len(a.everyone())) for a in agreed} == {(0, n)}
    assert max(s.ranges for s in stores) <= 3  # the third: everyone(), asked here


class _EventCounting:
    def __init__(self, owner: _RangeCounting, inner: Any) -> None:
        self.owner, self.inner = owner, inner

    def get(self, timeout: float | None = None) -> Any:
        events = self.inner.get(timeout)
        self.owner.events += len(events)
        return events

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> _EventCounting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _agree_all(n: int, shared: MemoryStore, gen_min: int, infos: Any) -> list[Agreement]:
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))

    def join(rank: int) -> Agreement:
        return agree(
            shared,
            coord,
            "j",
            rank,
            n,
            infos(rank),
            use_memory=True,
            disk_step=None,
            min_generation=gen_min,
            timeout_s=60.0,
        )

    with ThreadPoolExecutor(n) as pool:
        return [f.result() for f in [pool.submit(join, r) for r in range(n - 1, -1, -1)]]


def _record_bytes(shared: MemoryStore) -> int:
    return max(len(kv.value) for kv in shared.range("/stalwart/j/agreed/").kvs)


def test_the_agreement_every_survivor_reads_does_not_grow_with_the_members() -> None:
    """Issue 31: rank 0 published every member's info in the agreement and every member
    read it: N members reading N infos, O(N^2) bytes per failure. Now the record holds
    what every member needs (the restore point, who formed it, who leaves), the same
    size at any N, and every member still agrees on who formed the generation."""
    sizes = []
    for n in (3, 24):
        shared = MemoryStore()
        agreed = _agree_all(
            n, shared, 1, lambda r: {"steps": [3, 4], "done": 4, "rank": r, "pid": 100 + r}
        )
        assert {(a.target, a.tier) for a in agreed} == {(4, "memory")}
        assert len({members_of(a) for a in agreed}) == 1 and members_of(agreed[0])
        assert [len(a.everyone()) for a in agreed] == [n] * n  # read where needed
        sizes.append(_record_bytes(shared))
    assert sizes[0] == sizes[1]


def test_at_a_fresh_start_every_member_still_gets_the_infos_and_the_leavers() -> None:
    shared = MemoryStore()
    agreed = _agree_all(4, shared, 1, lambda r: {"steps": [], "done": 7 * (r % 2), "rank": r})
    assert {a.target for a in agreed} == {None}
    assert {tuple(leaving(a)) for a in agreed} == {(1, 3)}
    assert {len(a.infos) for a in agreed} == {4}  # no_common_point names what each held


def test_a_member_waiting_for_rank_0_moves_on_at_the_bump_without_reading_the_generation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 31: members waiting for rank 0's record read the generation every 0.25 s
    (8 requests a second per member with the long-poll; at 1,024 nodes more than the
    store answered). The bump now marks the generation's end under the watched prefix:
    with the members' own reads pushed out of reach, a bump still moves them on."""
    import threading

    from _load import wait_until

    from stalwart.runtime.rejoin import _rendezvous

    monkeypatch.setattr(_rendezvous, "_MEMBER_IDLE_S", 1e6)  # no read while waiting
    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    out: list[Agreement] = []

    def join(rank: int, min_generation: int) -> Agreement:
        return agree(
            shared,
            coord,
            "j",
            rank,
            2,
            {"steps": [4]},
            use_memory=True,
            disk_step=None,
            min_generation=min_generation,
            timeout_s=60.0,
        )

    def member() -> None:  # rank 1 of 2: rank 0 is gone until the bump
        out.append(join(1, 0))

    thread = threading.Thread(target=member, daemon=True)
    thread.start()
    arrived = lambda g: bool(shared.range(f"/stalwart/j/rt/{g:012d}.0/").kvs)  # noqa: E731
    assert wait_until(lambda: arrived(0), 10)
    assert coord.advance_generation(0, "node 0 lost").won
    assert wait_until(lambda: arrived(1), 10)  # it left generation 0's wait, joined 1
    rank0 = join(0, 1)
    thread.join(30)
    assert out and out[0].generation == rank0.generation == 1


class _CallCounting:
    """A member's store: every call by name (a round trip on a networked store)."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner, self.calls = inner, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def test_a_member_at_the_current_generation_arrives_and_waits_with_no_read() -> None:
    """Issue 31: a member read the generation, arrived, then read the agreement's prefix
    before its watch: three requests a member per failure before the wait. The arrival's
    transaction now checks the generation itself, and the watch starts after it."""
    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    assert coord.advance_generation(0, "node 3 lost").won
    n = 6
    stores = [_CallCounting(shared) for _ in range(n)]
    reads = [0]

    class Counting(Coordinator):
        def generation(self) -> int:
            reads[0] += 1
            return super().generation()

    def join(rank: int) -> Agreement:
        return agree(
            stores[rank],  # type: ignore[arg-type]
            Counting(stores[rank], CoordinatorConfig(job_id="j")),  # type: ignore[arg-type]
            "j",
            rank,
            n,
            {"steps": [7], "done": 7, "rank": rank},
            use_memory=True,
            disk_step=None,
            min_generation=1,
            timeout_s=60.0,
        )

    with ThreadPoolExecutor(n) as pool:  # rank 0 last
        agreed = [f.result() for f in [pool.submit(join, r) for r in range(n - 1, -1, -1)]]
    assert {(a.generation, a.target) for a in agreed} == {(1, 7)}
    for store in stores[1:]:
        assert store.calls["txn"] == 1 and store.calls["watch"] == 1
        assert store.calls["get"] == store.calls["range"] == 0, store.calls
    assert reads[0] == 0


def test_a_wrong_guess_joins_the_current_generation() -> None:
    """The caller's generation is a guess: below the job's (a worker started at 0 after
    two bumps) it costs one failed transaction and one read, and the member joins the
    current generation; above it (a member saw a collective fail) it moves the job."""
    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    for g in range(2):
        assert coord.advance_generation(g, "bump").won
    (a,) = _agree_all(1, shared, 0, lambda r: {"steps": [2], "done": 2, "rank": r})
    assert a.generation == 2
    (b,) = _agree_all(1, shared, 4, lambda r: {"steps": [2], "done": 2, "rank": r})
    assert b.generation >= 4 and coord.generation() == b.generation


def test_a_member_arriving_after_the_agreement_takes_it_and_a_fenced_one_stops() -> None:
    """A member whose rank 0 already published (its earlier arrival counted) takes the
    record instead of waiting for one that will not come; a member whose agent lost its
    lease still stops with FencedError, not a wrong generation."""
    from stalwart.coordinator import Compare
    from stalwart.errors import FencedError

    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    assert coord.advance_generation(0, "node 2 lost").won
    agreed = _agree_all(2, shared, 1, lambda r: {"steps": [5], "done": 5, "rank": r})
    assert {a.target for a in agreed} == {5}
    late = agree(
        shared,
        coord,
        "j",
        1,
        2,
        {"steps": [5], "done": 5, "rank": 1},
        use_memory=True,
        disk_step=None,
        min_generation=1,
        timeout_s=0.5,  # a wait for a record would time out
    )
    assert late.generation == 1 and late.target == 5
    gone = Compare("/stalwart/j/members/node1", "mod_revision", "==", 41)  # no such lease
    with pytest.raises(FencedError, match="lost its lease"):
        agree(
            shared,
            coord,
            "j",
            1,
            3,
            {"steps": [5]},
            use_memory=True,
            disk_step=None,
            min_generation=1,  # the record of generation 1 exists: not for a fenced one
            timeout_s=0.5,
            fence=[gone],
        )


class _BrokenWatches:
    """A member's store whose watches break at once (etcd closing every stream open),
    its reads answered."""

    def __init__(self, inner: MemoryStore) -> None:
        import threading

        self.inner = inner
        self.watching = threading.Event()

    def watch(self, prefix: str, start: int | None = None) -> Any:
        from stalwart.coordinator import StoreUnavailableError

        self.watching.set()

        class _Broken:
            def get(self, timeout: float | None = None) -> Any:
                raise StoreUnavailableError("etcd closed the watch stream before answering")

            def close(self) -> None:
                pass

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: object) -> None:
                pass

        return _Broken()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("broken", [(1, 2), (0, 1, 2)], ids=["members", "rank 0 too"])
def test_a_member_whose_watch_cannot_open_waits_by_reads(broken: tuple[int, ...]) -> None:
    """At 512 nodes etcd closed a node's every watch open for its whole reconnect timeout
    while its reads were answered, and the agreement failed the node (a member waiting
    for rank 0's record; rank 0 counting arrivals). Both now wait by reads."""
    shared = MemoryStore()
    coord = Coordinator(shared, CoordinatorConfig(job_id="j"))
    assert coord.advance_generation(0, "node 2 lost").won

    stores = {r: _BrokenWatches(shared) if r in broken else shared for r in range(3)}

    def join(rank: int) -> Agreement:
        return agree(
            stores[rank],  # type: ignore[arg-type]
            coord,
            "j",
            rank,
            3,
            {"steps": [9], "done": 9, "rank": rank},
            use_memory=True,
            disk_step=None,
            min_generation=1,
            timeout_s=60.0,
        )

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(join, 0)
        zero = stores[0]
        if isinstance(zero, _BrokenWatches):  # the members arrive once rank 0 watches
            assert zero.watching.wait(30)
        members = [pool.submit(join, r) for r in (1, 2)]
        agreed = [first.result()] + [f.result() for f in members]
    assert {(a.generation, a.target) for a in agreed} == {(1, 9)}


_DONE = "/stalwart/j/done/000000000000/"


def test_a_member_that_gives_up_at_the_finish_barrier_takes_its_arrival_back() -> None:
    """A member that timed out alone goes on to recover: its key must not let a member
    arriving later pass the barrier (which then says done for a job that is not)."""
    from stalwart.runtime.rejoin._rendezvous import finish_barrier

    store = MemoryStore()
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    assert not finish_barrier(store, coord, _DONE, (0, 2, 0), 0.2)  # A, alone
    assert store.range(_DONE).kvs == []  # its key is gone
    assert not finish_barrier(store, coord, _DONE, (1, 2, 0), 0.2)  # B: A is not there
    assert store.range(_DONE).kvs == []
    with ThreadPoolExecutor(2) as pool:  # arriving together, both pass
        both = [pool.submit(finish_barrier, store, coord, _DONE, (r, 2, 0), 30.0) for r in (0, 1)]
        assert [f.result() for f in both] == [True, True]


def test_a_member_leaving_the_finish_barrier_for_a_new_generation_takes_its_key() -> None:
    from stalwart.runtime.rejoin._rendezvous import finish_barrier

    store = MemoryStore()
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    assert coord.advance_generation(0, "a member failed").won
    assert not finish_barrier(store, coord, _DONE, (0, 2, 0), 30.0)  # at once, not at 30 s
    assert store.range(_DONE).kvs == []


def test_a_store_error_taking_the_arrival_back_still_answers_false() -> None:
    from stalwart.runtime.rejoin._rendezvous import finish_barrier

    class _NoDelete:
        def __init__(self, inner: MemoryStore) -> None:
            self.inner = inner

        def delete(self, key: str, prefix: bool = False) -> Any:
            raise ConnectionError("the store went away")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    store = MemoryStore()
    coord = Coordinator(store, CoordinatorConfig(job_id="j"))
    assert not finish_barrier(_NoDelete(store), coord, _DONE, (0, 2, 0), 0.1)
