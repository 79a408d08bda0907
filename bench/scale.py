"""The control plane at N nodes (issue 31): N emulated nodes against the real embedded
store (a process of its own) and a real etcd; see bench/_scale_nodes.py for what each
node runs (the agent's store-facing code, one store client and one lease per node; the
worker emulated by its progress reports: no torch, no gloo). The nodes are spread over
processes of ``--per-proc`` nodes each (bench/_scale_fleet.py), every one of them a real
client of the store over its real transport.

For every N and backend it measures:

* ``join_s``: from the nodes' start to every node's worker holding the agreement of
  generation 0 (connect, join with a lease, publish, agree);
* ``loss_to_agreement_s``: from a node's process dying (its connections closed; its
  ring successor revokes its lease, agent/cluster/_peerwatch.py) to every survivor holding the
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
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _scale_backends import start_embedded, start_etcd
from _scale_fleet import Fleet, client
from _scale_nodes import ROOT
from _scale_peers import in_child


def run_one(kind: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    # docs/scale.md, what to configure: 3 s, 10 s from 256 nodes, 30 s from 1,024
    lease_s = args.lease_s or (30.0 if n >= 1024 else 10.0 if n >= 256 else 3.0)
    if kind == "embedded":
        backend, token = start_embedded(
            # agent/cluster/_link.py max_connections: 4 per agent, 3 per worker
            max_connections=n * (4 + 3 * args.workers_per_node) + 64,
            nice=args.store_nice,
            own_group=args.store_group == "own",
        )
    else:
        backend, token = start_etcd(own_group=args.store_group == "own"), b""
    cfg: dict[str, Any] = {
        "lease_s": lease_s,
        "poll_s": args.poll_s,
        "step_s": args.step_s,
        "agree_timeout_s": args.timeout_s,
        "scan": args.scan,
        "verdict_s": args.verdict_s,
        "feed": not args.poll_generation,
        "relay": not args.no_relay,
        "arrivals": not args.no_arrival_relay,
        "workers": args.workers_per_node,
    }
    procs = args.procs or max(1, -(-n // args.per_proc))
    out: dict[str, Any] = {"n": n, "backend": kind, "procs": procs, "lease_s": lease_s}
    out["switch_ms"], out["store_group"] = args.switch_ms, args.store_group
    out["poll_s"], out["step_s"] = args.poll_s, args.step_s
    out["relay"] = not args.no_relay
    out["arrival_relay"] = not args.no_arrival_relay
    out["workers_per_node"] = args.workers_per_node
    if kind == "embedded" and args.store_nice:
        out["store_nice"] = args.store_nice
    config = {
        "backend": kind,
        "address": backend.address,
        "token": token.hex(),
        "lease_s": lease_s,
        "cfg": cfg,
        "switch_s": args.switch_ms / 1000,
    }
    fleet: Fleet | None = None
    try:
        fleet = Fleet(n, procs, config)
        _measure(fleet, backend, n, out, args)
    except Exception as err:  # the figures taken before it stay in the row
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if fleet is not None:
            fleet.close()
        backend.stop()
    return out


def _measure(fleet: Fleet, backend: Any, n: int, out: dict[str, Any], args: Any) -> None:
    """Formation, steady state and a node's loss, each figure into ``out`` as taken."""
    kind = out["backend"]
    j0, je0 = backend.stats(), fleet.cpu_s()
    t0 = fleet.start(args.ramp_s)
    joined = fleet.wait_agreed(0, f"{kind} formation of {n}", args.timeout_s + args.ramp_s)
    out["join_s"] = joined[-1] - t0
    out["join_p50_s"] = joined[len(joined) // 2] - t0
    # what forming cost: the store's CPU and the emulated nodes' (both on this host)
    out["join_store_cpu_s"] = backend.stats().cpu_s - j0.cpu_s
    out["join_emulator_cpu_s"] = fleet.cpu_s() - je0
    st_join = fleet.status(0)
    out["join_requests_per_node"] = st_join["ops"] / n
    out["join_requests_by_kind"] = {
        k: round(v / n, 3) for k, v in sorted(st_join["kinds"].items(), key=lambda kv: -kv[1])
    }
    if args.ramp_s:
        out["ramp_s"] = args.ramp_s
        out["join_after_last_start_s"] = joined[-1] - t0 - args.ramp_s * (n - 1) / n
    # steady state: every worker knows the snapshot cadence, the formation's load gone
    fleet.wait("the cadence", lambda st: bool(st["cadence"]), args.timeout_s)
    time.sleep(args.warm_s)
    s0, st0, w0, ce0 = backend.stats(), fleet.status(0), time.monotonic(), fleet.cpu_s()
    time.sleep(args.steady_s)
    s1, st1, w1, ce1 = backend.stats(), fleet.status(0), time.monotonic(), fleet.cpu_s()
    dt = w1 - w0
    # the emulated nodes' own steady CPU (cores): what is left of the host for a loss
    out["steady_emulator_cpu_frac"] = (ce1 - ce0) / dt
    out["store_ops_per_node_s"] = (st1["ops"] - st0["ops"]) / dt / n
    out["store_ops_s"] = (st1["ops"] - st0["ops"]) / dt
    out["steady_requests_by_kind"] = {  # per node per second
        k: round((v - st0["kinds"].get(k, 0)) / dt / n, 3)
        for k, v in sorted(st1["kinds"].items(), key=lambda kv: -kv[1])
        if v > st0["kinds"].get(k, 0)
    }
    out["coordinator_cpu_frac"] = (s1.cpu_s - s0.cpu_s) / dt
    out["coordinator_cpu_frac_per_node"] = out["coordinator_cpu_frac"] / n
    out["coordinator_cpu_ms_per_request"] = (
        1000 * (s1.cpu_s - s0.cpu_s) / max(1, st1["ops"] - st0["ops"])
    )
    out["coordinator_rss_mb"] = s1.rss_mb
    out["store_roundtrips_per_rank_step"] = (st1["step_ops"] - st0["step_ops"]) / max(
        1, st1["steps"] - st0["steps"]
    )
    out["steps_per_node_s"] = (st1["steps"] - st0["steps"]) / dt / n
    # the emulator itself saturated: its latencies are its own, not the store's
    out["emulator_saturated"] = out["steps_per_node_s"] < 0.9 / args.step_s
    out["load_avg"] = os.getloadavg()[0]
    c0, st_before = backend.stats(), fleet.status(0)
    e0 = fleet.cpu_s()
    took = _lose(fleet, n - 1, 1, args, peer=True)
    c1, st_after, e1 = backend.stats(), fleet.status(1), fleet.cpu_s()
    # what the loss cost, whole (O(N) total work: a constant per survivor): the store's
    # requests (the steady ones in that time included) and CPU, the emulated nodes' CPU
    out["loss_requests_per_survivor"] = (st_after["ops"] - st_before["ops"]) / (n - 1)
    out["loss_requests_by_kind"] = {
        k: round((v - st_before["kinds"].get(k, 0)) / (n - 1), 3)
        for k, v in sorted(st_after["kinds"].items(), key=lambda kv: -kv[1])
        if v > st_before["kinds"].get(k, 0)
    }
    out["loss_store_cpu_s"] = c1.cpu_s - c0.cpu_s
    out["loss_emulator_cpu_s"] = e1 - e0
    out["loss_to_agreement_s"] = took[-1]
    out["loss_to_agreement_p50_s"] = took[len(took) // 2]
    out["loss_to_bump_s"] = fleet.status(1)["bumped_at"] - _LOST_AT[0]
    gen = 1
    if args.lease_loss:
        gen += 1
        out["lease_loss_to_agreement_s"] = _lose(fleet, n - 2, gen, args, peer=False)[-1]
    if args.writer_loss and kind == "etcd":
        _lose_writer(fleet, n, gen + 1, out, args)


def _lose_writer(fleet: Fleet, n: int, gen: int, out: dict[str, Any], args: Any) -> None:
    """Kill the agent that writes the live-nodes digest (agent/cluster/_livenodes.py; under
    etcd the first to claim it): the part's claims at its loss, and the time to agree."""
    store = client(fleet.config, n + 1)
    try:
        kv = store.get(f"{ROOT}/live/writer")
    finally:
        store.close()
    writer = int(kv.value.split()[0])
    dead = {n - 1, n - 2} if args.lease_loss else {n - 1}
    watcher = next(i % n for i in range(writer + 1, writer + n) if i % n not in dead)
    before = fleet.status(gen - 1)
    t_loss = fleet.lose(writer, watcher, peer=True)
    agreed = fleet.wait_agreed(gen, f"agreement after losing the writer {writer}", args.timeout_s)
    # the claims come after the agreement (the vacancy is seen by each reader's watch)
    claims = lambda st: st["kinds"].get("txn /live/writer", 0)  # noqa: E731
    fleet.wait("a new writer", lambda st: claims(st) > claims(before), args.timeout_s)
    time.sleep(1.0)  # the claims in flight land: a count, not a wait for a condition
    after = fleet.status(gen)
    out["writer"] = writer
    out["writer_loss_to_agreement_s"] = max(t - t_loss for t in agreed)
    out["writer_loss_to_bump_s"] = after["bumped_at"] - t_loss
    out["writer_loss_claims"] = claims(after) - claims(before)


def _lose(
    fleet: Fleet, victim: int, gen: int, args: argparse.Namespace, *, peer: bool
) -> list[float]:
    """Kill ``victim``; each survivor's seconds until it agreed on generation ``gen``."""
    t_loss = fleet.lose(victim, 0, peer=peer)  # node 0: its ring successor
    _LOST_AT[0] = t_loss
    agreed = fleet.wait_agreed(gen, f"agreement after losing node {victim}", args.timeout_s)
    return [t - t_loss for t in agreed]


_LOST_AT = [0.0]  # the last loss's instant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="16,64,256,1024", help="node counts, comma-separated")
    p.add_argument(
        "--backends", default="embedded,etcd,torchrun,torchft", help="torchrun, torchft: the peers"
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=0.0,
        help="the agent's --node-lease (0: 3 s, 10 s from 256)",
    )
    p.add_argument("--per-proc", type=int, default=128, help="emulated nodes per process")
    p.add_argument(
        "--ramp-s", type=float, default=0.0, help="nodes start evenly over this (0: at once)"
    )
    p.add_argument("--procs", type=int, default=0, help="emulator processes (0: from --per-proc)")
    p.add_argument(
        "--poll-s",
        type=float,
        default=0.5,
        help="each emulated agent's poll tick (the agent's own: 0.1 s). A killed node's "
        "path is woken, not polled (a silent node's, --lease-loss, waits for the adopter's "
        "tick), and a poll makes no store request (its figures come from watches): the "
        "tick costs the emulator's CPU, which 1,024 agents share on this host (0.1 s, and "
        "0.2 s steps: 0.75 of a core, idle) where a job's agents each have a host",
    )
    p.add_argument(
        "--step-s", type=float, default=1.0, help="an emulated step's time (a report each)"
    )
    p.add_argument("--warm-s", type=float, default=3.0)
    p.add_argument("--steady-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument(
        "--scan",
        default="view",
        choices=("view", "members", "range"),
        help="live nodes from one writer's digest (agent/cluster/_livenodes.py), from every "
        "node following every member key (agent/cluster/_members.py, before the digest), or a "
        "range per read (before issue 31; run with PYTHONPATH=<main>/src for the whole old "
        "control plane)",
    )
    p.add_argument(
        "--verdict-s",
        type=float,
        default=0.0,
        help="0: the verdict from a watch (agent/cluster/_follow.py); > 0: a read this often "
        "(1 s before the watch, 0.1 s before issue 31)",
    )
    p.add_argument(
        "--poll-generation", action="store_true", help="the agent reads it per poll (before)"
    )
    p.add_argument(
        "--no-relay",
        action="store_true",
        help="each worker watches the generation in the store (before the agent's relay)",
    )
    p.add_argument(
        "--no-arrival-relay",
        action="store_true",
        help="each worker arrives and awaits the agreement in the store itself (before the "
        "agent's arrival relay, agent/cluster/_arrivals.py)",
    )
    p.add_argument(
        "--workers-per-node",
        type=int,
        default=1,
        help="workers per emulated node; each arrives and waits for the agreement itself, "
        "as a real node's workers do (8 for a node of 8 GPUs)",
    )
    p.add_argument("--lease-loss", action="store_true", help="also a silent node's loss")
    p.add_argument(
        "--writer-loss",
        action="store_true",
        help="etcd: also the loss of the agent writing the live-nodes digest (its claims)",
    )
    p.add_argument(
        "--store-nice",
        type=int,
        default=0,
        help="the embedded store's nice value (negative: root): the emulator's ~N busy "
        "threads on this host take the cores node 0 would have to itself on a real job",
    )
    p.add_argument(
        "--switch-ms",
        type=float,
        default=50.0,
        help="the emulator processes' GIL switch interval (CPython's default: 5): ~1,000 "
        "threads in a process each wake this often to ask for the GIL while another runs",
    )
    p.add_argument(
        "--store-group",
        choices=("own", "shared"),
        default="own",
        help="own: the coordinator starts a session (a CPU group under autogroup "
        "scheduling) of its own, as node 0 has a host of its own; shared: the bench's",
    )
    args = p.parse_args()
    curves: dict[str, list[dict[str, Any]]] = {}
    for n in [int(x) for x in args.n.split(",")]:
        for kind in args.backends.split(","):
            t = time.monotonic()
            try:
                if kind == "torchrun":
                    row = {"backend": kind, **in_child("torchrun", n, args.timeout_s)}
                elif kind == "torchft":
                    row = {"backend": kind, **in_child("torchft", n, args.timeout_s)}
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
    for kind in ("torchrun", "torchft"):  # a peer that did not form at n_max: say so
        failed = [r for r in curves.get(kind, []) if r["n"] == n_max and "error" in r]
        if failed:
            out[f"{kind}_error_at_n_max"] = failed[0]["error"]
            formed = [r["n"] for r in ok.get(kind, [])]
            out[f"{kind}_largest_n_formed"] = max(formed) if formed else None
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
