"""The peers of bench/scale.py at the same N (issue 31): torch.distributed.elastic's c10d
rendezvous and torchft's lighthouse, N participants in one process (threads), each with
its own client connection, as the nodes of a real job.

* ``torchrun(n)``: the real ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend``
  on one ``TCPStore`` (torchrun's ``--rdzv-backend c10d``). ``join_s``: N handlers'
  ``next_rendezvous`` until every one returned a round of N. ``rerendezvous_s``: one
  participant dies (its keep-alive stops), the N-1 survivors call ``next_rendezvous``
  (what torchrun's agent does after a worker group fails) until every one holds a
  round of N-1. The dead node leaves the round when its keep-alive lapses
  (``keep_alive_interval`` x ``keep_alive_max_attempt``, set here to the agent's 3 s
  lease), and the round closes ``last_call_timeout`` after ``min_nodes`` joined.
  torch names each of the rendezvous's events by calling ``inspect.stack()`` twice
  (``dynamic_rendezvous.get_method_name``: every frame's source lines read); N handlers
  in one process pay that under one GIL, where a real job's agents each pay it on a host
  of their own, and 64 handlers did not form in 120 s. The bench names the event from
  the same frame without reading source (``_frame_name``): what is measured is the
  protocol, a compare-and-set of one key holding every participant, over TCPStore.
* ``torchft(n)``: a ``LighthouseServer``; N replicas (``LighthouseClient`` each, a
  heartbeat thread each as the Manager's) call ``quorum``. ``quorum_s``: until all N
  hold a quorum of N. ``quorum_after_loss_s``: one replica stops heartbeating and
  calling; the N-1 call ``quorum`` until every one holds a quorum of N-1 (the lighthouse
  drops a replica ``heartbeat_timeout_ms`` after its last heartbeat).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

__all__ = ["in_child", "torchft", "torchrun"]

LEASE_S = 3  # the agent's default --node-lease: each peer's failure detection set alike


def _frame_name(depth: int = 2) -> str:
    """torch's ``get_method_name``: the calling function's name ``depth`` frames up,
    taken from the frame, not from ``inspect.stack()`` (which reads every frame's source)."""
    return sys._getframe(depth).f_code.co_name


def torchrun(n: int, timeout_s: float, last_call_s: float = 1.0) -> dict[str, Any]:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    dynamic_rendezvous.get_method_name = _frame_name  # type: ignore[assignment]
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = master.port
    timeout = RendezvousTimeout(
        join=timedelta(seconds=timeout_s),
        last_call=timedelta(seconds=last_call_s),
        close=timedelta(seconds=10),
        heartbeat=timedelta(seconds=LEASE_S),
    )

    def handler(i: int) -> Any:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
        backend = C10dRendezvousBackend(store, "scale")
        return DynamicRendezvousHandler.from_backend(
            "scale",
            store,
            backend,
            min_nodes=n - 1,
            max_nodes=n,
            local_addr="127.0.0.1",  # (a node is told apart by its pid and handler id)
            timeout=timeout,
            keep_alive_interval=1,
            keep_alive_max_attempt=LEASE_S,
        )

    with ThreadPoolExecutor(min(n, 64)) as pool:
        handlers = list(pool.map(handler, range(n)))
    out: dict[str, Any] = {"n": n, "last_call_s": last_call_s, "keep_alive_s": LEASE_S}
    phase = "join"
    try:
        with ThreadPoolExecutor(n) as pool:
            t0 = time.monotonic()
            worlds = list(pool.map(lambda h: _world(h.next_rendezvous()), handlers))
            out["join_s"] = time.monotonic() - t0
            out["join_worlds"] = sorted(set(worlds))
            phase = "re-rendezvous after a loss"
            dead, survivors = handlers[-1], handlers[:-1]
            t0 = time.monotonic()
            dead._stop_heartbeats()  # the process dies: nothing says goodbye
            worlds = list(pool.map(lambda h: _world(h.next_rendezvous()), survivors))
            out["rerendezvous_s"] = time.monotonic() - t0
            out["rerendezvous_worlds"] = sorted(set(worlds))
    except RendezvousTimeoutError:
        raise RuntimeError(
            f"torchrun's c10d {phase} of {n} did not complete within {timeout_s:.0f}s"
        ) from None
    finally:
        for h in handlers:
            h._stop_heartbeats()
        del master
    return out


def _world(info: Any) -> int:
    return int(getattr(info, "world_size", None) or info[2])


def torchft(n: int, timeout_s: float) -> dict[str, Any]:
    from torchft._torchft import LighthouseClient, LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=n - 1,
        join_timeout_ms=int(timeout_s * 1000),
        quorum_tick_ms=100,
        heartbeat_timeout_ms=LEASE_S * 1000,
    )
    addr = server.address()
    out: dict[str, Any] = {"n": n, "heartbeat_timeout_s": LEASE_S}
    stop = [threading.Event() for _ in range(n)]
    clients = [LighthouseClient(addr, timedelta(seconds=timeout_s)) for _ in range(n)]

    def beat(i: int) -> None:
        while not stop[i].wait(0.1 * LEASE_S):  # the Manager's heartbeat
            try:
                clients[i].heartbeat(f"r{i}")
            except Exception:
                return

    def quorum(i: int) -> int:
        q = clients[i].quorum(replica_id=f"r{i}", timeout=timedelta(seconds=timeout_s))
        return len(q.participants)

    beats = [threading.Thread(target=beat, args=(i,), daemon=True) for i in range(n)]
    try:
        for i in range(n):
            clients[i].heartbeat(f"r{i}")
            beats[i].start()
        with ThreadPoolExecutor(n) as pool:
            t0 = time.monotonic()
            sizes = list(pool.map(quorum, range(n)))
            out["quorum_s"] = time.monotonic() - t0
            out["quorum_sizes"] = sorted(set(sizes))
            t0 = time.monotonic()
            stop[-1].set()  # the replica dies: no heartbeat, no quorum call
            sizes = list(pool.map(quorum, range(n - 1)))
            out["quorum_after_loss_s"] = time.monotonic() - t0
            out["quorum_after_loss_sizes"] = sorted(set(sizes))
    finally:
        for s in stop:
            s.set()
        for t in beats:
            t.join(5)
        server.shutdown()
    return out


def in_child(kind: str, n: int, timeout_s: float) -> dict[str, Any]:
    """``torchrun(n)`` or ``torchft(n)`` in a process of its own (``python
    bench/_scale_peers.py KIND N TIMEOUT``): N handlers' or clients' threads, sockets and
    runtimes end with it, not in the bench's process, where the emulated nodes of the
    next run would share the host with whatever they left."""
    import json
    import subprocess

    cmd = [sys.executable, __file__, kind, str(n), str(timeout_s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * timeout_s + 60)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{kind} at {n} failed (exit {proc.returncode}): {tail[:300]}")
    row: dict[str, Any] = json.loads(lines[-1])
    return row


if __name__ == "__main__":
    import json

    name, count, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    run = {"torchrun": torchrun, "torchft": torchft}[name]
    print(json.dumps(run(count, limit)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # (threads a peer left do not hold the process open)
