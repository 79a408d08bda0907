"""The control plane at N nodes (issue 31): N emulated nodes against the real embedded
store (a process of its own) and a real etcd; see bench/_scale_nodes.py for what each
node runs (the agent's store-facing code, one store client and one lease per node; the
worker emulated by its progress reports: no torch, no gloo).

For every N and backend it measures:

* ``join_s``: from the nodes' start to every node's worker holding the agreement of
  generation 0 (connect, join with a lease, publish, agree);
* ``loss_to_agreement_s``: from a node's process dying (its connections closed; its
  ring successor revokes its lease, agent/_peerwatch.py) to every survivor holding the
  new generation and the agreed restore step;
* ``lease_loss_to_agreement_s`` (``--lease-loss``): the same for a node that goes
  silent (its lease expires);
* steady state: store round trips per node per second, the coordinator's CPU (fraction
  of one core) and RSS, and store round trips per rank per step.

Usage: ``python bench/scale.py --n 16,64,256 [--backends embedded,etcd,torchrun,torchft]``
(torchrun, torchft: the peers at the same N, bench/_scale_peers.py). The final
line is JSON (docs/scale.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _scale_backends import Backend, start_embedded, start_etcd
from _scale_nodes import Counter, Node, wait_until
from _scale_peers import torchft, torchrun


def _clients(kind: str, backend: Backend, token: bytes, n: int, lease_s: float) -> list[Any]:
    host, port = backend.address.rsplit(":", 1)
    if kind == "embedded":
        from stalwart.agent._link import agent_client_config
        from stalwart.coordinator import StoreClient

        conf = agent_client_config(lease_s)
        return [StoreClient(host, int(port), token, conf) for _ in range(n)]
    from stalwart.coordinator import EtcdStore, EtcdStoreConfig

    conf2 = EtcdStoreConfig(reconnect_timeout=2 * lease_s, marker_ttl=60)
    return [EtcdStore([(host, int(port))], "/scale/", conf2) for _ in range(n)]


def _all_agreed(nodes: list[Node], generation: int) -> bool:
    return all(generation in node.agreed for node in nodes)


def run_one(kind: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    if kind == "embedded":
        backend, token = start_embedded(max_connections=8 * n + 64)
    else:
        backend, token = start_etcd(), b""
    alive = set(range(n))
    cfg: dict[str, Any] = {
        "n": n,
        "lease_s": args.lease_s,
        "poll_s": args.poll_s,
        "step_s": args.step_s,
        "agree_timeout_s": args.timeout_s,
        "backend": kind,
        "live": lambda: sorted(alive),
        "scan": args.scan,
        "verdict_s": args.verdict_s,
        "feed": not args.poll_generation,
    }
    ops, steps = Counter(), Counter()
    nodes = [
        Node(i, c, ops, steps, cfg)
        for i, c in enumerate(_clients(kind, backend, token, n, args.lease_s))
    ]
    out: dict[str, Any] = {"n": n, "backend": kind}
    try:
        t0 = time.monotonic()
        for node in nodes:
            node.thread.start()
        wait_until(f"{kind} formation of {n}", lambda: _all_agreed(nodes, 0), args.timeout_s)
        out["join_s"] = max(node.agreed[0] for node in nodes) - t0
        # steady state: every worker knows the snapshot cadence, the formation's load gone
        wait_until("the cadence", lambda: all(x.cadence.every for x in nodes), args.timeout_s)
        time.sleep(args.warm_s)
        s0, o0, c0 = backend.stats(), ops.n, steps.n
        k0, w0 = sum(node.step for node in nodes), time.monotonic()
        time.sleep(args.steady_s)
        s1, o1, c1 = backend.stats(), ops.n, steps.n
        k1, w1 = sum(node.step for node in nodes), time.monotonic()
        dt = w1 - w0
        out["store_ops_per_node_s"] = (o1 - o0) / dt / n
        out["store_ops_s"] = (o1 - o0) / dt
        out["coordinator_cpu_frac"] = (s1.cpu_s - s0.cpu_s) / dt
        out["coordinator_cpu_frac_per_node"] = out["coordinator_cpu_frac"] / n
        out["coordinator_rss_mb"] = s1.rss_mb
        out["store_roundtrips_per_rank_step"] = (c1 - c0) / max(1, k1 - k0)
        out["steps_per_node_s"] = (k1 - k0) / dt / n
        out["loss_to_agreement_s"] = _lose(nodes, alive, n - 1, 1, args, peer=True)
        out["loss_to_bump_s"] = nodes[0].bumped_at - _LOST_AT[0]
        out["loss_to_agreement_p50_s"] = _LOST_AT[1]
        if args.lease_loss:
            out["lease_loss_to_agreement_s"] = _lose(nodes, alive, n - 2, 2, args, peer=False)
    finally:
        _teardown(nodes)
        backend.stop()
    return out


def _lose(
    nodes: list[Node],
    alive: set[int],
    victim: int,
    gen: int,
    args: argparse.Namespace,
    *,
    peer: bool,
) -> float:
    """Kill ``victim``; seconds until every survivor agreed on generation ``gen``."""
    alive.discard(victim)
    t_loss = time.monotonic()
    nodes[victim].kill()
    if peer:  # its ring successor (node 0) sees the connection end
        nodes[0].peer_gone(victim)
    survivors = [node for node in nodes if node.idx in alive]
    wait_until(
        f"agreement after losing node {victim}", lambda: _all_agreed(survivors, gen), args.timeout_s
    )
    took = sorted(node.agreed[gen] - t_loss for node in survivors)
    _LOST_AT[:] = [t_loss, took[len(took) // 2]]
    return took[-1]


_LOST_AT = [0.0, 0.0]  # the last loss: when, and its median survivor's agreement


def _teardown(nodes: list[Node]) -> None:
    for node in nodes:
        node.stop.set()
        if hasattr(node, "genwatch"):
            node.genwatch.moved.set()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(_close, nodes))


def _close(node: Node) -> None:
    node.thread.join(10)
    if hasattr(node, "genwatch"):
        node.genwatch.close()
    node.close_feed()
    with contextlib.suppress(Exception):  # already closed (killed)
        node.inner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="16,64,256,1024", help="node counts, comma-separated")
    p.add_argument(
        "--backends", default="embedded,etcd,torchrun,torchft", help="torchrun, torchft: the peers"
    )
    p.add_argument("--lease-s", type=float, default=3.0, help="the agent's --node-lease")
    p.add_argument("--poll-s", type=float, default=0.1, help="the agent's store poll")
    p.add_argument("--step-s", type=float, default=0.2, help="an emulated step's time")
    p.add_argument("--warm-s", type=float, default=3.0)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument(
        "--scan",
        default="view",
        choices=("view", "range"),
        help="live nodes from a membership watch (agent/_members.py) or a range per read "
        "(before issue 31; run with PYTHONPATH=<main>/src for the whole old control plane)",
    )
    p.add_argument("--verdict-s", type=float, default=1.0, help="0.1 before issue 31")
    p.add_argument(
        "--poll-generation", action="store_true", help="the agent reads it per poll (before)"
    )
    p.add_argument("--lease-loss", action="store_true", help="also a silent node's loss")
    args = p.parse_args()
    # emulated workers take no collective per step: some learn the cadence late, said once
    from stalwart.logs import get_logger

    get_logger("stalwart.runtime._cadence").setLevel(logging.ERROR)
    curves: dict[str, list[dict[str, Any]]] = {}
    for n in [int(x) for x in args.n.split(",")]:
        for kind in args.backends.split(","):
            t = time.monotonic()
            try:
                if kind == "torchrun":
                    row = {"backend": kind, **torchrun(n, args.timeout_s)}
                elif kind == "torchft":
                    row = {"backend": kind, **torchft(n, args.timeout_s)}
                else:
                    row = run_one(kind, n, args)
            except Exception as err:
                row = {"n": n, "backend": kind, "error": f"{type(err).__name__}: {err}"}
            row["wall_s"] = time.monotonic() - t
            print(json.dumps(row), flush=True)
            curves.setdefault(kind, []).append(row)
    print(json.dumps(_summary(curves)))


def _summary(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ok = {k: [r for r in rows if "error" not in r] for k, rows in curves.items()}
    ours = [r for k in ("embedded", "etcd") for r in ok.get(k, [])]
    n_max = max((r["n"] for r in ours), default=0)
    out: dict[str, Any] = {"n_max": n_max}
    for kind, rows in ok.items():
        top = [r for r in rows if r["n"] == n_max]
        if top and kind == "torchrun":
            out["torchrun_join_s"] = round(top[0]["join_s"], 3)
            out["torchrun_rerendezvous_s"] = round(top[0]["rerendezvous_s"], 3)
            continue
        if top and kind == "torchft":
            out["torchft_quorum_s"] = round(top[0]["quorum_s"], 3)
            out["torchft_quorum_after_loss_s"] = round(top[0]["quorum_after_loss_s"], 3)
            continue
        if top:
            out[f"{kind}_join_s"] = round(top[0]["join_s"], 3)
            out[f"{kind}_loss_to_agreement_s"] = round(top[0]["loss_to_agreement_s"], 3)
            out[f"{kind}_cpu_frac"] = round(top[0]["coordinator_cpu_frac"], 3)
    emb = [r for r in ok.get("embedded", []) if r["n"] == n_max]
    if emb:
        out["coordinator_cpu_frac"] = round(emb[0]["coordinator_cpu_frac"], 3)
        out["coordinator_rss_mb"] = round(emb[0]["coordinator_rss_mb"], 1)
    steps = [
        r["store_roundtrips_per_rank_step"]
        for rows in ok.values()
        for r in rows
        if "store_roundtrips_per_rank_step" in r
    ]
    out["store_roundtrips_per_rank_step"] = max(steps) if steps else None
    out["curves"] = curves
    return out


if __name__ == "__main__":
    main()
