"""`stalwart check`: is this node fit to join a job? (docs/detection.md)"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stalwart.cli._etcd_flags import add_etcd_security_flags, refuse_without_rdzv, with_security

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="preflight node check: matmul + allreduce with a partner node, and the "
        "health probes, once; exit 1 if this node is slow or failing",
        description=(
            "Run on every node with the node flags the job would get (--nnodes, "
            "--node-rank, --rdzv-endpoint or --rdzv). Nodes are paired for a matmul and "
            "an allreduce; a node far slower than the others is paired again with a "
            "fast one to tell a slow node from a slow link (DLRover's method)."
        ),
    )
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None, help="check id (shared by the nodes)")
    p.add_argument("--rdzv", default=None, help="etcd[s]://HOST:PORT/JOB-ID (as stalwart run)")
    add_etcd_security_flags(p)
    p.add_argument("--run-dir", default=None, help="where events.jsonl goes (default runs/ID)")
    p.add_argument("--token-file", default=None, help="job token file (nodes > 0)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address this node's check listens on for its partner (stalwart run: --replica-host)",
    )
    p.add_argument(
        "--factor",
        type=float,
        default=3.0,
        help="a node slower than this many times the fastest is slow (default 3)",
    )
    p.add_argument("--probes", default="all", help="all, none or some of host,shm,disk,nvml")
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    from stalwart.agent import LaunchConfig
    from stalwart.agent.health.preflight import PreflightConfig, check_node
    from stalwart.agent.health.probes import ProbeConfig, parse_probe_names

    kwargs: dict[str, Any] = {}
    if args.rdzv:
        from stalwart.coordinator import parse_etcd_url

        kwargs.update(rdzv=with_security(args.rdzv, args), job=parse_etcd_url(args.rdzv).job_id)
    else:
        refuse_without_rdzv(args)
        if args.rdzv_id:
            kwargs["job"] = args.rdzv_id
    cfg = LaunchConfig(
        script=__file__,  # never run: LaunchConfig wants a script, the check has none
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        run_dir=args.run_dir or "",
        token_file=args.token_file,
        replica_host=args.host,
        probes=ProbeConfig(names=parse_probe_names(args.probes)),
        **kwargs,
    )
    result = check_node(cfg, PreflightConfig(factor=args.factor))
    for n, v in sorted(result.verdicts.items()):
        mark = "ok  " if v.ok else "UNFIT"
        print(f"node {n}: {mark} {v.verdict}: {v.detail}")
    for r in result.probes:
        state = "skipped" if r.skipped else ("ok" if r.ok else "FAILED")
        where = f" GPU {r.device}" if r.device is not None else ""
        print(f"node {args.node_rank} probe {r.probe}{where}: {state}: {r.detail}")
    print(f"preflight took {result.seconds:.1f} s", file=sys.stderr)
    return 0 if result.fit(args.node_rank) else 1
