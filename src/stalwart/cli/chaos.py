"""`stalwart chaos RUN_DIR FAULT...`: inject faults into a live `stalwart run`.

The request is a file in ``RUN_DIR/chaos/requests/``; every agent of the run polls that
directory (a few times a second) and fires the faults aimed at its ranks or its node. A
fault without ``at=`` fires now; ``at=time:`` counts from the moment it was queued. A fault
aimed outside the run's job (a rank or a node its ``run_start`` does not have) is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["queue_faults", "register"]


def _with_default_trigger(spec: str) -> str:
    parts = []
    for part in (p.strip() for p in spec.split(";")):
        if part and not any(tok.startswith("at=") for tok in part.split()):
            part += " at=time:0s"
        if part:
            parts.append(part)
    return "; ".join(parts)


def queue_faults(run_dir: str, spec: str) -> str:
    """Validate ``spec`` and queue it for the agents of the run in ``run_dir``."""
    from stalwart.chaos import FaultPlan

    if not os.path.exists(os.path.join(run_dir, "events.jsonl")):
        raise ConfigError(f"{run_dir}: not the run directory of a `stalwart run` (no events.jsonl)")
    spec = _with_default_trigger(spec)
    plan = FaultPlan.parse(spec)  # one-line error naming the bad token
    shape = _job_shape(run_dir)
    if shape is not None:  # a fault no agent of the run would fire: refuse it now
        plan.check_targets(world_size=shape[0], nnodes=shape[1])
    requests = os.path.join(run_dir, "chaos", "requests")
    os.makedirs(requests, mode=0o700, exist_ok=True)
    name = f"{time.time_ns()}.json"
    tmp = os.path.join(requests, f".{name}.tmp")
    # 0600: agents accept only requests of the job's user that no one else can rewrite
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump({"spec": spec}, f)
    os.replace(tmp, os.path.join(requests, name))
    return spec


def _job_shape(run_dir: str) -> tuple[int, int] | None:
    """(world size, nodes) from the run's newest ``run_start`` (None: not known yet)."""
    from stalwart.metrics import read_events

    events = read_events(os.path.join(run_dir, "events.jsonl")).events
    starts = [e for e in events if e.kind == "run_start"]
    if not starts:
        return None
    world, nodes = starts[-1].get("world_size"), starts[-1].get("nnodes")
    if isinstance(world, int) and isinstance(nodes, int) and world > 0 and nodes > 0:
        return world, nodes
    return None


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="inject faults into a live run",
        description="Queue faults for a live `stalwart run`, e.g. "
        "`stalwart chaos runs/job7 kill rank=1` or `... hang node=1 at=step:300`.",
    )
    p.add_argument("run_dir")
    p.add_argument("spec", nargs="+", help="chaos spec (quote it, or pass its words)")
    p.set_defaults(func=_chaos)


def _chaos(args: argparse.Namespace) -> int:
    spec = queue_faults(args.run_dir, " ".join(args.spec))
    print(f"queued for {args.run_dir}: {spec}")
    return 0
