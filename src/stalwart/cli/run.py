"""`stalwart run`: torchrun-style launcher with detection and recovery."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from stalwart.cli._async_flags import async_flags, outer_settings
from stalwart.cli._detect_flags import detection, detection_flags
from stalwart.cli._etcd_flags import add_etcd_security_flags, refuse_without_rdzv, with_security
from stalwart.cli._integrity_flags import integrity_flags
from stalwart.cli._knob_flags import knob_flag, runtime_knobs
from stalwart.cli._node_flags import node_flags, node_options
from stalwart.compat import warn_untested_torch
from stalwart.contract.env import Strategy
from stalwart.errors import ConfigError

__all__ = ["EXIT_NOT_ADMITTED", "register"]

_COUNT = re.compile(r"[0-9]{1,9}", re.ASCII)  # str.isdigit() also passes '²', int() does not


def _range(text: str, flag: str) -> tuple[int | None, int]:
    """``N`` -> (None, N); ``MIN:MAX`` -> (MIN, MAX). The job starts with MAX; MIN
    matters under --strategy elastic (the fewest it trains with)."""
    low, sep, high = text.partition(":")
    if not _COUNT.fullmatch(high if sep else low) or (sep and not _COUNT.fullmatch(low)):
        raise ConfigError(f"{flag} {text!r}: use N or MIN:MAX, e.g. {flag} 2:4")
    return (int(low), int(high)) if sep else (None, int(low))


def register(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="launch a training script on this node (torchrun-compatible flags)",
        description=(
            "Launch SCRIPT with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). "
            "Scripts that call stalwart.init() recover in place (--strategy flash/spare); "
            "plain scripts are restarted as torchrun would (--max-restarts)."
        ),
        # the script's own flags follow it: never read `--out` as an abbreviation of ours
        allow_abbrev=False,
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        help="workers per node: N (or MIN:MAX with --strategy elastic; MAX are started)",
    )
    p.add_argument(
        "--nnodes",
        default="1",
        help="N (or MIN:MAX: MAX nodes start; --strategy elastic trains down to MIN)",
    )
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None, help="job id (default: random)")
    p.add_argument(
        "--rdzv-conf",
        default=None,
        help='the --rdzv target from a JSON file: {"endpoints": ["h:2379"], "job": "job7"}',
    )
    p.add_argument(
        "--rdzv",
        default=None,
        help="etcd[s]://HOST:PORT[,HOST:PORT...]/JOB-ID: keep the coordinator in etcd, so "
        "the job survives the loss of any node (default: node 0 hosts an embedded store)",
    )
    add_etcd_security_flags(p)
    p.add_argument("--standalone", action="store_true", help="single node (the default)")
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=3,
        help="the job's restart budget: whole-job restarts (torchrun's route, taken by "
        "--strategy restart, plain scripts and a node loss under restart; default 3, "
        "torchrun's is 0). In-place recoveries (flash, spare, elastic) do not spend it; "
        "they end when a rank is blocklisted (3 failures in 10 min) or crash-loops",
    )
    p.add_argument(
        "--crash-loop-limit",
        type=int,
        default=3,
        help="a rank failing this many times in a row at the same step (or at start-up) "
        "ends the job with a one-line verdict instead of being restarted again (default 3)",
    )
    p.add_argument(
        "--blocklist-after",
        type=int,
        default=3,
        help="failures of one rank within 10 minutes that blocklist it and end the job "
        "(default 3: a rank that keeps failing sits on sick hardware)",
    )
    p.add_argument(
        "--run-dir",
        "--log-dir",
        "--log_dir",
        dest="run_dir",
        default=None,
        help="run directory: events.jsonl, token, logs, ckpt (default runs/JOB); reused, it "
        "resumes from ckpt/ and the previous run's records move to RUN_DIR/prev/N",
    )
    p.add_argument("--strategy", default="flash", help="restart | flash | spare | elastic | async")
    async_flags(p)
    p.add_argument(
        "--elastic-wait",
        type=float,
        default=600.0,
        help="elastic: seconds to wait for members below MIN before failing (default 600)",
    )
    p.add_argument(
        "--spares", type=int, default=0, help="pre-forked spare processes per node (spare)"
    )
    p.add_argument(
        "--standby",
        action="store_true",
        help="keep the ranks this node would adopt if their node were lost running here, "
        "set-up done and parked before their first step, so a lost node's ranks resume "
        "without starting processes (stalwart.init() scripts; flash or spare); under "
        "spare also for this node's own ranks: a failed rank resumes past its set-up",
    )
    p.add_argument(
        "--chaos",
        default=None,
        help='e.g. "kill rank=1 at=step:50; hang rank=0 at=time:40s" (time: from the first '
        "step; a plain script's step N is its Nth optimizer.step())",
    )
    p.add_argument(
        "--redirect", action="store_true", help="worker output to RUN_DIR/logs/rank<R>.log"
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="job token file (nodes > 0; with --rdzv etcd: the same file on every node)",
    )
    detection_flags(p)
    knob_flag(p, "collective_timeout_s")
    p.add_argument(
        "--node-lease",
        type=float,
        default=3.0,
        help="seconds without a heartbeat before a node counts as lost (default 3)",
    )
    p.add_argument(
        "--partition-grace",
        type=float,
        default=5.0,
        help="seconds a node whose lease expired with no other sign of a fault (a short "
        "partition) may rejoin before it is declared lost for good (default 5; 0: lost at "
        "once; docs/detection.md)",
    )
    p.add_argument(
        "--zygote-ready-cpu",
        type=float,
        default=300.0,
        help="CPU seconds the node's zygote may spend importing torch and the script's "
        "imports before it is ready (default 300; its CPU, not the clock: a loaded "
        "machine does not make it fail)",
    )
    p.add_argument(
        "--zygote-stall",
        type=float,
        default=120.0,
        help="seconds the starting zygote may use no CPU at all before it counts as "
        "stuck (default 120)",
    )
    knob_flag(p, "persist_every")
    knob_flag(p, "keep_last")
    knob_flag(p, "keep_every")
    knob_flag(p, "snapshot_every")
    knob_flag(p, "snapshot_budget")
    integrity_flags(p)
    p.add_argument(
        "--replica-rate",
        type=float,
        default=0.0,
        help="stream each node's newest snapshots to a buddy node's memory at up to this "
        "many MB/s, so a lost node's ranks restore without disk (default 0: off)",
    )
    p.add_argument(
        "--replica-host",
        default="",
        help="address this node's peer watch and replica receiver bind and advertise to "
        "the other nodes (default: this node's address on the route to the rendezvous "
        "endpoint; 127.0.0.1 when every node is on one host)",
    )
    p.add_argument(
        "--ckpt-tier",
        metavar="URL",
        default=None,
        help="a bucket (s3://bucket/prefix) that RUN_DIR/ckpt's checkpoints are uploaded to "
        "in the background, and restored from on a fresh run dir (docs/checkpoint-storage.md)",
    )
    p.add_argument("--s3-endpoint", metavar="URL", default=None, help="the bucket's S3 endpoint")
    p.add_argument(
        "--tier-keep-last",
        type=int,
        default=None,
        help="committed checkpoints kept in the --ckpt-tier bucket (default: --keep-last)",
    )
    p.add_argument(
        "--tier-keep-every",
        type=int,
        default=None,
        help="milestones kept in the --ckpt-tier bucket (default: --keep-every)",
    )
    node_flags(p)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)


EXIT_NOT_ADMITTED = 4
"""`stalwart run`'s exit code for a node the job will not take (it was lost or failed too
often and is blocklisted): distinct from 2 (bad input), so an orchestrator can end the
node's pod or task as done while the job trains on (docs/launch.md, exit codes)."""


def _run(args: argparse.Namespace) -> int:
    from stalwart.agent import LaunchConfig, ZygoteStart, run_agent
    from stalwart.chaos import FaultPlan
    from stalwart.coordinator.errors import BlocklistedError

    FaultPlan.parse(args.chaos)  # a bad spec fails here, before anything starts
    warn_untested_torch()  # the workers' torch (stalwart.compat): one line, not an error
    if args.s3_endpoint and not args.ckpt_tier:
        raise ConfigError("--s3-endpoint is the endpoint of --ckpt-tier: pass --ckpt-tier too")
    if (args.tier_keep_last or args.tier_keep_every) is not None and not args.ckpt_tier:
        raise ConfigError("--tier-keep-last/--tier-keep-every apply to --ckpt-tier: pass it too")
    min_nodes, nnodes = _range(args.nnodes, "--nnodes")
    min_procs, nprocs = _range(args.nproc_per_node, "--nproc-per-node")
    if args.standalone and nnodes > 1:
        raise ConfigError("--standalone runs one node; drop --nnodes or --standalone")
    given = args.strategy
    strategy = Strategy.parse(given, lambda fix: ConfigError(f"--strategy {given!r}: {fix}"))
    knobs = runtime_knobs(args, strategy, outer_settings(args))
    kwargs = _rendezvous(args)
    cfg = LaunchConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        nproc_per_node=nprocs,
        nnodes=nnodes,
        min_nnodes=min_nodes,
        min_nproc_per_node=min_procs,
        elastic_wait_s=args.elastic_wait,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        run_dir=args.run_dir or "",
        max_restarts=args.max_restarts,
        strategy=strategy,
        spares=args.spares,
        chaos=args.chaos,
        redirect=args.redirect,
        token_file=args.token_file,
        crash_loop_limit=args.crash_loop_limit,
        blocklist_after=args.blocklist_after,
        **detection(args),
        runtime=knobs,
        node_lease_s=args.node_lease,
        partition_grace_s=args.partition_grace,
        zygote=ZygoteStart(cpu_s=args.zygote_ready_cpu, stall_s=args.zygote_stall),
        replica_rate_mb_s=args.replica_rate,
        standby=args.standby,
        replica_host=args.replica_host,
        ckpt_tier=args.ckpt_tier,
        s3_endpoint=args.s3_endpoint,
        tier_keep_last=args.tier_keep_last,
        tier_keep_every=args.tier_keep_every,
        **node_options(args),
        **kwargs,
    )
    try:
        return run_agent(cfg)
    except BlocklistedError as err:  # not the user's error: the job just runs without us
        print(f"stalwart: {err}; the job goes on without this node", file=sys.stderr)
        return EXIT_NOT_ADMITTED


def _rendezvous(args: argparse.Namespace) -> dict[str, Any]:
    """The job id and etcd URL of --rdzv-id, --rdzv and --rdzv-conf (LaunchConfig's
    ``job`` and ``rdzv``; absent: a fresh job id, the embedded store)."""
    kwargs: dict[str, Any] = {}
    if args.rdzv_id:
        kwargs["job"] = args.rdzv_id
    if args.rdzv_conf:
        from stalwart.agent.cluster.etcd import rdzv_from_file

        if args.rdzv:
            raise ConfigError("--rdzv and --rdzv-conf exclude each other; pass one")
        args.rdzv = rdzv_from_file(args.rdzv_conf)
    if args.rdzv:
        from stalwart.coordinator import parse_etcd_url

        target = parse_etcd_url(args.rdzv)
        if args.rdzv_id and args.rdzv_id != target.job_id:
            raise ConfigError(
                f"--rdzv-id {args.rdzv_id!r} differs from the job id in --rdzv "
                f"({target.job_id!r}); drop --rdzv-id"
            )
        kwargs["job"] = target.job_id
        kwargs["rdzv"] = with_security(args.rdzv, args)
    else:
        refuse_without_rdzv(args)
    return kwargs
