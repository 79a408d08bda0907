"""torchft's side of bench/elastic.py: two replica groups (one worker each) on gloo, the
demo's transformer, replica 1 killed with SIGKILL at step 50; prints one JSON line with
``survivor_stall_s``: the longest the survivor waited for a commit after the kill (replica
1 kills itself only while both replicas are in the quorum).

Runs the lighthouse in this process and each replica in a child (``--replica``). Needs
torchft (0.2.0 measured) importable; imports it only here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def replica(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    sys.path.insert(0, str(ROOT / "examples"))
    from train_lm import TinyLM, batch

    torch.manual_seed(0)
    model = TinyLM(128, 128, 2, 64)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load(sd: dict[str, object]) -> None:
        model.load_state_dict(sd["model"])  # type: ignore[arg-type]
        inner.load_state_dict(sd["optim"])  # type: ignore[arg-type]

    def save() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load,
        state_dict=save,
        replica_id=f"replica{args.replica}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    log = open(Path(args.work) / f"ft-r{args.replica}.jsonl", "a")  # noqa: SIM115
    while manager.current_step() < args.steps:
        step = manager.current_step()
        # kill only while both replicas are in the quorum (a replica still healing is not)
        if args.replica == 1 and step >= args.kill_step and manager.num_participants() == 2:
            (Path(args.work) / "ft-kill").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        x, y = batch(step, args.replica, 8, 64, 128)
        loss = F.cross_entropy(ddp(x).reshape(-1, 128), y.reshape(-1))
        loss.backward()
        opt.step()
        if manager.current_step() > step:  # committed (a failed step is not)
            log.write(json.dumps({"t": time.time(), "step": manager.current_step()}) + "\n")
            log.flush()
    manager.shutdown()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--replica", type=int, default=None)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--kill-step", type=int, default=50)
    p.add_argument("--heartbeat-timeout", type=float, default=None, help="seconds")
    args = p.parse_args()
    if args.replica is not None:
        replica(args)
        return 0
    from torchft._torchft import LighthouseServer

    work = Path(args.work)
    for f in work.glob("ft-*"):
        f.unlink()
    kwargs = {}
    if args.heartbeat_timeout is not None:
        kwargs["heartbeat_timeout_ms"] = int(args.heartbeat_timeout * 1000)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, **kwargs)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--work",
                str(work),
                "--replica",
                str(r),
                "--lighthouse",
                lighthouse.address(),
                "--steps",
                str(args.steps),
                "--kill-step",
                str(args.kill_step),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in (0, 1)
    ]
    try:
        procs[0].wait(timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
    t_kill = float((work / "ft-kill").read_text())
    steps = [json.loads(x) for x in (work / "ft-r0.jsonl").read_text().splitlines()]
    after = [s["t"] for s in steps if s["t"] > t_kill][:100]
    before = [s["t"] for s in steps if s["t"] <= t_kill]
    gaps = [b - a for a, b in itertools.pairwise(before)][-10:]
    # the stall: the longest wait for a commit after the kill (a step in flight at the
    # kill may still commit at once; the next one waits for the dead replica's timeout)
    waits = [b - max(a, t_kill) for a, b in itertools.pairwise([t_kill, *after])]
    print(
        json.dumps(
            {
                "survivor_stall_s": max(waits) if waits else None,
                "first_commit_after_kill_s": after[0] - t_kill if after else None,
                "step_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
                "heartbeat_timeout_s": args.heartbeat_timeout,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
