"""EtcdStore against a real etcd, beyond the shared conformance suite: compaction,
exactly-once writes when replies are lost, etcd killed mid-run, leader loss, fencing.

Each test on the ``etcd`` fixture runs twice: against a plain etcd, and against the etcd a
production job meets (etcd_secure.py: TLS, client certificates, auth on, the store logged
in as a job's user whose role grants that job's prefix only). Compaction needs etcd's root
and the leader test a cluster: those run on a plain etcd only."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _load import scaled

from stalwart.coordinator import (
    CompactedError,
    Compare,
    Coordinator,
    CoordinatorConfig,
    LeaseNotFoundError,
    Put,
    StoreUnavailableError,
)
from stalwart.coordinator.etcd import EtcdStore
from stalwart.errors import FencedError

from .conftest import etcd_config
from .etcd_secure import running_secure_etcd
from .etcd_server import EtcdServer, running_etcd, running_etcd_cluster


@dataclass
class Etcd:
    """A running etcd and how a store reaches it: ``url`` (TLS and credentials) or, for
    a plain etcd, None (its port, namespace ``/t/``)."""

    server: EtcdServer
    url: str | None = None

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()

    def address(self) -> str:
        """What the member process of _partition_member.py is given to connect with."""
        return self.url or str(self.server.client_port)


@pytest.fixture(params=["plain", "tls"])
def etcd(request: pytest.FixtureRequest) -> Iterator[Etcd]:
    if request.param == "plain":
        with running_etcd() as server:
            yield Etcd(server)
    else:
        with running_secure_etcd() as secure:
            yield Etcd(secure.server, secure.url())


@pytest.fixture
def plain_etcd() -> Iterator[Etcd]:
    with running_etcd() as server:
        yield Etcd(server)


def connect(etcd: Etcd, **overrides: float) -> EtcdStore:
    if etcd.url is not None:
        return EtcdStore.from_url(etcd.url, etcd_config(**overrides))
    port = etcd.server.client_port
    return EtcdStore([("127.0.0.1", port)], "/t/", etcd_config(**overrides))


# -- against a real etcd ------------------------------------------------------------


def test_compacted_history_is_an_error(plain_etcd: Etcd) -> None:
    store = connect(plain_etcd)
    for i in range(10):
        store.put("c", str(i).encode())
    latest = store.range("").revision
    store.compact(latest - 2)
    with pytest.raises(CompactedError):
        store.watch("c", 1)
    with store.watch("c", latest) as watch:
        assert [e.kv.value for e in watch.get(5.0)] == [b"9"]
    store.close()


def lose_replies(store: EtcdStore, path: str, count: int) -> list[int]:
    """Make the next ``count`` calls to ``path`` reach etcd but lose their reply."""
    real: Callable[..., Any] = store._http._attempt
    lost = [0]

    def attempt(p: str, payload: bytes, what: str) -> Any:
        result = real(p, payload, what)
        if p == path and lost[0] < count:
            lost[0] += 1
            raise ConnectionResetError("reply lost (injected by the test)")
        return result

    setattr(store._http, "_attempt", attempt)  # noqa: B010 - patching a method on purpose
    return lost


def test_lost_replies_do_not_apply_writes_twice(etcd: Etcd) -> None:
    store = connect(etcd)
    lost = lose_replies(store, "/v3/kv/txn", 1)
    rev = store.put("k", b"1")
    kv = store.get("k")
    assert lost == [1] and kv is not None and (kv.version, kv.mod_revision) == (1, rev)
    assert store.range("").revision == rev

    # a CAS whose reply is lost still reports that it won
    lose_replies(store, "/v3/kv/txn", 1)
    res = store.txn([Compare("k", "value", "==", b"1")], [Put("k", b"2")], [Put("lost", b"")])
    assert res.succeeded and res.revision == rev + 1 and store.get("lost") is None
    # ... and a failed one that it lost
    lose_replies(store, "/v3/kv/txn", 1)
    res = store.txn([Compare("k", "value", "==", b"1")], [Put("k", b"3")], [Put("lost", b"")])
    lost_kv = store.get("lost")
    assert not res.succeeded and lost_kv is not None and lost_kv.version == 1

    for i in range(3):
        store.put(f"d/{i}", b"")
    lose_replies(store, "/v3/kv/txn", 1)
    rev = store.range("").revision
    assert store.delete("d/", prefix=True) == 3
    assert store.range("").revision == rev + 1

    lose_replies(store, "/v3/lease/grant", 1)
    lease = store.grant(30)
    assert store.time_to_live(lease) is not None
    lose_replies(store, "/v3/lease/revoke", 1)
    assert store.revoke(lease) is True
    store.close()


def commit_steps_through_faults(
    store: EtcdStore, steps: int, faults: dict[int, Callable[[], None]]
) -> list[float]:
    """Commit steps 1..``steps`` in a thread; run ``faults[k]`` once step k is committed.
    Check every step was committed exactly once, in order; return each fault's pause
    (fault start -> the next commit)."""
    coord = Coordinator(store, CoordinatorConfig(job_id="job"))
    gen = coord.advance_generation(0, "start").generation
    start_rev = store.range("").revision + 1
    done: list[float] = []
    progressed = threading.Condition()
    errors: list[BaseException] = []

    def commit_all() -> None:
        try:
            for step in range(1, steps + 1):
                coord.commit_step(gen, step, by="w0")
                with progressed:
                    done.append(time.monotonic())
                    progressed.notify_all()
        except BaseException as exc:
            errors.append(exc)
            with progressed:
                progressed.notify_all()

    worker = threading.Thread(target=commit_all)
    worker.start()
    started: list[float] = []
    try:
        for after, fault in sorted(faults.items()):

            def reached(a: int = after) -> bool:
                return len(done) >= a or bool(errors)

            with progressed:
                assert progressed.wait_for(reached, 30)
            started.append(time.monotonic())
            fault()
    finally:
        worker.join(60)
    assert not errors, errors
    last = coord.last_step()
    assert last is not None and last.step == steps
    with store.watch(coord._k("step"), start_rev) as watch:
        events: list[Any] = []
        while len(events) < steps:
            batch = watch.get(5.0)
            assert batch, f"only {len(events)} step events"
            events += batch
        assert watch.get(0.3) == []
    assert [json.loads(e.kv.value)["step"] for e in events] == list(range(1, steps + 1))
    return [min(t for t in done if t > s) - s for s in started]


def test_commit_sequence_survives_etcd_kills(etcd: Etcd) -> None:
    """SIGKILL etcd three times mid-sequence and restart it on the same data dir: each
    step commits exactly once, in order, and the client just pauses."""
    store = connect(etcd, reconnect_timeout=20.0)

    def restart() -> None:
        etcd.kill()
        etcd.start()

    pauses = commit_steps_through_faults(store, 45, {10: restart, 20: restart, 30: restart})
    print(f"etcd failover pauses (kill -> next commit): {[f'{p:.2f}s' for p in pauses]}")
    store.close()


def leader_index(members: list[EtcdServer]) -> int:
    for i, member in enumerate(members):
        status = EtcdStore([("127.0.0.1", member.client_port)], "/t/", etcd_config())
        try:
            doc = status._http.post("/v3/maintenance/status", {}, "status")
        finally:
            status.close()
        if doc.get("leader") == doc["header"]["member_id"]:
            return i
    raise AssertionError("no etcd member is the leader")


def test_commits_fail_over_when_the_etcd_leader_dies() -> None:
    """A 3-member cluster: kill the leader (the client's first endpoint), go on through
    the others, restart it later; every step is committed exactly once."""
    with running_etcd_cluster(3) as members:
        leader = members[leader_index(members)]
        ordered = [leader, *(m for m in members if m is not leader)]
        endpoints = [("127.0.0.1", m.client_port) for m in ordered]
        store = EtcdStore(endpoints, "/t/", etcd_config(reconnect_timeout=20.0))
        faults = {10: leader.kill, 25: lambda: leader.start(wait=False)}
        watch = store.watch("/stalwart/job/step")
        assert watch.get(0.05) == []  # its stream is open on the leader now
        pauses = commit_steps_through_faults(store, 40, faults)
        print(f"leader loss pause: {pauses[0]:.2f}s")
        seen: list[Any] = []
        while len(seen) < 40:  # the broken stream reopens on another member, no gap
            batch = watch.get(5.0)
            assert batch, f"the watch stopped after {len(seen)} steps"
            seen += batch
        assert [json.loads(e.kv.value)["step"] for e in seen] == list(range(1, 41))
        watch.close()
        assert leader.proc is not None
        leader.wait_healthy()
        store.close()


def test_watch_resumes_after_restart_without_gaps_or_repeats(etcd: Etcd) -> None:
    store = connect(etcd)
    with store.watch("w/") as watch:
        store.put("w/1", b"")
        assert [e.kv.key for e in watch.get(5.0)] == ["w/1"]
        etcd.kill()
        etcd.start()
        store.put("w/2", b"")
        store.put("w/3", b"")
        seen = watch.get(10.0)
        seen += watch.get(0.5)
        assert [e.kv.key for e in seen] == ["w/2", "w/3"]
    store.close()


def test_outage_beyond_the_deadline_raises_then_recovers(etcd: Etcd) -> None:
    store = connect(etcd, reconnect_timeout=1.0)
    store.put("k", b"1")
    watch = store.watch("k")
    etcd.kill()
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"unreachable for 1\.0s"):
        store.put("k", b"2")
    assert 1.0 <= time.monotonic() - started < 4.0
    with pytest.raises(StoreUnavailableError):
        while time.monotonic() - started < 10:
            watch.get(0.5)
    etcd.start()
    assert store.get("k") is not None  # the same client works again
    watch.close()
    store.close()


def test_expired_member_is_fenced_across_coordinators(etcd: Etcd) -> None:
    """Two coordinators on one etcd: a member that stops heartbeating loses its lease,
    the other bumps the generation, and the stale member's commits are refused."""
    # the lease sized for the load (a starved etcd or heartbeat thread loses a 1 s lease
    # that is alive: tests/_load.py)
    ttl = scaled(1.0)
    cfg = CoordinatorConfig(job_id="job", lease_ttl=ttl, heartbeat_interval=0.2)
    store_a, store_b = connect(etcd), connect(etcd)
    a, b = Coordinator(store_a, cfg), Coordinator(store_b, cfg)
    gen = a.advance_generation(0, "start").generation
    member_a = a.join("a")
    member_b = b.join("b")
    member_b.start_heartbeat()
    a.commit_step(gen, 1, by="a")
    with b.watch_members(store_b.range("").revision + 1) as members:
        until = time.monotonic() + 2 * ttl
        while time.monotonic() < until:  # alive past its TTL while it heartbeats
            member_a.heartbeat()
            time.sleep(0.2)
        assert set(a.members()) == {"a", "b"}
        # "a" stops heartbeating (a partition); its lease expires in etcd
        deadline = time.monotonic() + ttl + scaled(9.0)
        events: list[Any] = []
        while not any(e.kind == "left" and e.member_id == "a" for e in events):
            assert time.monotonic() < deadline, "lease of 'a' never expired"
            events += members.get(deadline - time.monotonic())
    change = b.advance_generation(gen, "member a lost its lease")
    assert change.won and change.generation == gen + 1
    b.commit_step(change.generation, 2, by="b")
    with pytest.raises(FencedError, match="stale"):
        a.commit_step(gen, 2, by="a")
    with pytest.raises(FencedError):
        a.commit_checkpoint(gen, 2, by="a")
    with pytest.raises(LeaseNotFoundError):
        member_a.heartbeat()
    last = b.last_step()
    assert last is not None and (last.step, last.by) == (2, "b")
    with a.join("a"):  # rejoins cleanly, then commits in the new generation
        a.commit_step(change.generation, 3, by="a")
    member_b.leave()
    store_a.close()
    store_b.close()


class _Child:
    """A subprocess speaking one reply line per command line, read with deadlines."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )

    def read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no reply from the member process within {timeout}s"
        return self.proc.stdout.readline().decode().strip()

    def ask(self, command: str, timeout: float = 15.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self.read_line(timeout)

    def end(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case the test left it stopped
            self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def test_sigstopped_member_is_fenced_and_rejoins(etcd: Etcd) -> None:
    """A member process frozen (SIGSTOP) past its 1 s lease, as in a partition: the
    others see it leave and move to a new generation; once resumed it cannot commit
    with its old generation, learns its lease is gone, and rejoins cleanly."""
    store = connect(etcd)
    coord = Coordinator(store, CoordinatorConfig(job_id="job"))
    gen = coord.advance_generation(0, "start").generation
    script = str(Path(__file__).with_name("_partition_member.py"))
    child = _Child([sys.executable, script, etcd.address()])
    try:
        assert child.read_line(30) == "joined"
        assert child.ask(f"commit {gen} 1") == "ok"
        with coord.watch_members(store.range("").revision + 1) as members:
            os.kill(child.proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + scaled(10.0)
            left = False
            while not left:
                assert time.monotonic() < deadline, "the stopped member's lease never expired"
                batch = members.get(deadline - time.monotonic())
                left = any(e.kind == "left" and e.member_id == "a" for e in batch)
        change = coord.advance_generation(gen, "member a partitioned")
        assert change.won
        coord.commit_step(change.generation, 2, by="survivor")
        os.kill(child.proc.pid, signal.SIGCONT)
        assert child.ask(f"commit {gen} 3").startswith("fenced ")
        deadline = time.monotonic() + scaled(10.0)
        while child.ask("lost") != "LeaseNotFoundError":
            assert time.monotonic() < deadline, "the resumed member never noticed its lost lease"
        assert child.ask("rejoin") == "ok"
        assert "a" in coord.members()
        assert child.ask(f"commit {change.generation} 3") == "ok"
        last = coord.last_step()
        assert last is not None and (last.step, last.generation, last.by) == (3, 2, "a")
        assert child.ask("exit") == "bye"
    finally:
        child.end()
    store.close()
