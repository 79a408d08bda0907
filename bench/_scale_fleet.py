"""The emulated nodes of bench/scale.py spread over K processes (issue 31): one Python
process running 256 nodes' clients, heartbeats and watches on 2 loaded cores starved
itself (its GIL and its one scheduler entity), and 256 did not form. Each process here
runs a slice of the nodes (bench/_scale_nodes.py: the agent's store-facing code, one
store client and one lease per node, each over its real transport), and takes commands
from the bench on its stdin, one JSON line each, answering one JSON line on stdout.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the
machine), so a node's agreement time in one process compares with the loss's instant
taken in the bench. Run as ``python bench/_scale_fleet.py`` (a child; the bench starts
it): the first line is its config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["Fleet", "slices"]


def slices(n: int, procs: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` node ranges of ``procs`` processes covering ``n`` nodes evenly."""
    procs = max(1, min(procs, n))
    edges = [n * k // procs for k in range(procs + 1)]
    return [(edges[k], edges[k + 1]) for k in range(procs)]


class _Child:
    def __init__(self, lo: int, hi: int, config: dict[str, Any], log: IO[bytes]) -> None:
        self.lo, self.hi = lo, hi
        cmd = [sys.executable, __file__]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        self.send({**config, "lo": lo, "hi": hi})

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"emulator process of nodes {self.lo}-{self.hi - 1} died")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Fleet:
    """N emulated nodes in ``procs`` processes, driven from the bench."""

    def __init__(self, n: int, procs: int, config: dict[str, Any]) -> None:
        self.n = n
        self.config = config
        self.logdir = tempfile.mkdtemp(prefix="scale-fleet-")
        self._log = open(Path(self.logdir) / "nodes.log", "wb")  # noqa: SIM115 (closed in close)
        self.children: list[_Child] = []
        try:
            for lo, hi in slices(n, procs):
                self.children.append(_Child(lo, hi, {**config, "n": n}, self._log))
            self._all({"op": "ready"})  # every client built, nothing connected yet
        except BaseException:
            self.close()
            raise

    def _all(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        for child in self.children:
            child.send(msg)
        return [child.read() for child in self.children]

    def _owner(self, idx: int) -> _Child:
        return next(c for c in self.children if c.lo <= idx < c.hi)

    def start(self, ramp_s: float = 0.0) -> float:
        """Start every node, node k at ``k / n * ramp_s`` (0: all at once, a launcher
        that starts every agent in the same second); the first's instant (monotonic)."""
        t0 = time.monotonic()
        self._all({"op": "start", "t0": t0, "ramp_s": ramp_s})
        return t0

    def status(self, gen: int) -> dict[str, Any]:
        """Summed over the processes: nodes alive, their agreement times of ``gen``,
        whether every worker knows the cadence, counters, dead node threads."""
        replies = self._all({"op": "status", "gen": gen})
        out: dict[str, Any] = {"agreed": [], "alive": 0, "cadence": True, "failed": 0}
        for key in ("steps", "ops", "step_ops"):
            out[key] = sum(r[key] for r in replies)
        out["kinds"] = {}
        for r in replies:
            for kind, count in r["kinds"].items():
                out["kinds"][kind] = out["kinds"].get(kind, 0) + count
            out["agreed"] += r["agreed"]
            out["alive"] += r["alive"]
            out["cadence"] = out["cadence"] and r["cadence"]
            out["failed"] += r["failed"]
        out["bumped_at"] = max(r["bumped_at"] for r in replies)
        return out

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the emulator processes used so far."""
        from _scale_backends import proc_stats

        return sum(proc_stats(c.proc.pid).cpu_s for c in self.children)

    def wait_agreed(self, gen: int, what: str, timeout_s: float) -> list[float]:
        """Every live node's agreement time of ``gen``, once all agreed (sorted)."""
        deadline = time.monotonic() + timeout_s
        last = -1
        while True:
            st = self.status(gen)
            if len(st["agreed"]) == st["alive"]:
                return sorted(st["agreed"])
            if len(st["agreed"]) != last:  # progress, at most a line a second
                last = len(st["agreed"])
                print(f"  {what}: {last}/{st['alive']} agreed", file=sys.stderr, flush=True)
            if time.monotonic() > deadline or st["failed"]:  # a failed node never agrees
                raise RuntimeError(
                    f"{what}: {len(st['agreed'])} of {st['alive']} nodes agreed within "
                    f"{timeout_s:.0f}s ({st['failed']} node threads failed; "
                    f"see {self.logdir}/nodes.log)"
                )
            time.sleep(1.0)

    def wait(self, what: str, cond: Callable[[dict[str, Any]], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond(self.status(0)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not within {timeout_s:.0f}s")
            time.sleep(0.25)

    def lose(self, victim: int, by: int, *, peer: bool) -> float:
        """Every process drops ``victim`` from its live list, its process kills it, and
        (``peer``) node ``by``, its ring successor, sees its connection end. The
        instant of the kill (monotonic)."""
        self._all({"op": "dead", "idx": victim})
        owner = self._owner(victim)
        owner.send({"op": "kill", "idx": victim})
        t_loss = float(owner.read()["t"])
        if peer:
            watcher = self._owner(by)
            watcher.send({"op": "peer_gone", "by": by, "idx": victim})
            watcher.read()
        return t_loss

    def close(self) -> None:
        """Stop every node (each process tears its own down) and reap every process."""
        for child in self.children:
            with contextlib.suppress(OSError, ValueError):
                child.send({"op": "stop"})
        for child in self.children:
            child.reap(60)
            for pipe in (child.proc.stdin, child.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        self._log.close()


# ------------------------------------------------------------------ the child


def loopback(idx: int) -> str:
    """Node ``idx``'s own source address (127.0.0.0/8 is all loopback on Linux): the
    store admits handshakes per peer address, and a real node has a host of its own."""
    hi, lo = divmod(idx, 254)
    return f"127.{1 + hi // 256}.{hi % 256}.{lo + 1}"


def client(config: dict[str, Any], idx: int) -> Any:
    """A store client as emulated node ``idx``'s (its own loopback source address)."""
    host, port = str(config["address"]).rsplit(":", 1)
    lease_s = float(config["lease_s"])
    if config["backend"] == "embedded":
        import dataclasses

        from stalwart.agent.cluster._link import agent_client_config
        from stalwart.coordinator import StoreClient

        conf = dataclasses.replace(agent_client_config(lease_s), source_address=loopback(idx))
        return StoreClient(host, int(port), bytes.fromhex(config["token"]), conf)
    from stalwart.coordinator import EtcdStore, EtcdStoreConfig

    conf = EtcdStoreConfig(reconnect_timeout=2 * lease_s, marker_ttl=int(max(60, 4 * lease_s)))
    return EtcdStore([(host, int(port))], "/scale/", conf)


def _child() -> None:
    from _scale_nodes import Counter, Node

    from stalwart.coordinator import StoreError
    from stalwart.logs import get_logger

    # the nodes' warnings (a renewal retried, a watch reopened) go to nodes.log, once per
    # kind and node at most a second (logging's own lock serialises the threads)
    logging.basicConfig(level=logging.WARNING, format="%(threadName)s %(name)s: %(message)s")
    get_logger("stalwart.runtime.steps._cadence").setLevel(logging.ERROR)
    config = json.loads(sys.stdin.readline())
    # ~1,000 threads share this process's GIL; a thread waiting for it wakes every switch
    # interval to ask for it (CPython's take_gil), 200,000 wake-ups a second at the
    # default 5 ms: the emulator's overhead, not a node's (an agent has ~8 threads on a
    # host of its own). Its threads block on sockets, so a longer interval delays none.
    sys.setswitchinterval(float(config.get("switch_s", 0.005)))
    lo, hi, n = int(config["lo"]), int(config["hi"]), int(config["n"])
    alive = set(range(n))
    cfg = {**config["cfg"], "n": n, "backend": config["backend"], "live": lambda: sorted(alive)}
    ops, steps = Counter(), Counter()
    nodes = {i: Node(i, client(config, i), ops, steps, cfg) for i in range(lo, hi)}
    mine = set(nodes)

    def status(gen: int) -> dict[str, Any]:
        live = [nodes[i] for i in sorted(mine & alive)]
        return {
            "agreed": [x.agreed[gen] for x in live if gen in x.agreed],
            "alive": len(live),
            "cadence": all(x.cadence.every for x in live if hasattr(x, "cadence")),
            "steps": sum(x.step for x in live),
            "ops": ops.n,
            "kinds": dict(ops.kinds),
            "step_ops": steps.n,
            "failed": sum(1 for x in live if x.thread.ident and not x.thread.is_alive()),
            "bumped_at": max((x.bumped_at for x in live), default=0.0),
        }

    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        reply: dict[str, Any] = {"ok": True}
        if op == "start":
            threading.Thread(target=_ramp, args=(nodes, n, msg), daemon=True).start()
        elif op == "status":
            reply = status(int(msg["gen"]))
            if not all(hasattr(x, "cadence") for x in nodes.values()):
                reply["cadence"] = False
        elif op == "dead":
            alive.discard(int(msg["idx"]))
        elif op == "kill":
            nodes[int(msg["idx"])].kill()
            reply = {"t": time.monotonic()}
        elif op == "peer_gone":
            with contextlib.suppress(StoreError):
                nodes[int(msg["by"])].peer_gone(int(msg["idx"]))
        elif op == "stop":
            _teardown(list(nodes.values()))
            print(json.dumps(reply), flush=True)
            return
        print(json.dumps(reply), flush=True)


def _ramp(nodes: dict[int, Any], n: int, msg: dict[str, Any]) -> None:
    t0, ramp_s = float(msg["t0"]), float(msg["ramp_s"])
    for idx, node in sorted(nodes.items()):
        time.sleep(max(0.0, t0 + ramp_s * idx / n - time.monotonic()))
        node.thread.start()


def _teardown(nodes: list[Any]) -> None:
    for node in nodes:
        node.stop.set()
        if hasattr(node, "genwatch"):
            node.genwatch.moved.set()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(_close, nodes))


def _close(node: Any) -> None:
    if node.thread.ident:
        node.thread.join(10)
    if hasattr(node, "genwatch"):
        node.genwatch.close()
    node.close_feed()
    with contextlib.suppress(Exception):  # already closed (killed)
        node.inner.close()


if __name__ == "__main__":
    _child()
