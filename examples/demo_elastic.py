"""`make demo-elastic` (examples/demo.py --elastic): 2 nodes x 2 workers under
``--strategy elastic``, constant global batch, against a fixed 4-worker run.

Faults: rank 3 killed for good, then node 1 lost for good (the job holds at 2 workers),
then node 1 joins again (node 0 starts its members; they get the state from a survivor's
memory by transfer). Printed: every resize (world size, micro-batches, learning rate, how
long the survivors stopped), whether every optimizer step read the same samples as the
fixed run, and how far the loss curves are apart (float summation order only, which AdamW
amplifies over hundreds of steps: the curve, as 25-step means, must agree within 1e-2; the
largest single-step difference is printed too; docs/elastic.md). The
fixed run uses the same launcher and strategy without faults, so the steps before the
first fault are bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "train_elastic.py"
TOLERANCE = 1e-2  # relative, on 25-step means of the loss; why: docs/elastic.md
WINDOW = 25
LAUNCH = ("--nnodes", "1:2", "--nproc-per-node", "1:2", "--strategy", "elastic")


def _trace(run_dir: Path) -> dict[int, tuple[float, list[int], int]]:
    """step -> (global mean loss, samples read, world size) of its committed attempt."""
    recs = [
        json.loads(line)
        for f in (run_dir / "trace").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    last: dict[int, int] = {}
    for r in recs:
        last[r["step"]] = max(last.get(r["step"], -1), r["gen"])
    out: dict[int, tuple[float, list[int], int]] = {}
    for step in sorted(last):
        mine = [r for r in recs if r["step"] == step and r["gen"] == last[step]]
        loss = sum(r["loss"] for r in mine) / len(mine)
        out[step] = (loss, sorted(i for r in mine for i in r["samples"]), len(mine))
    return out


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return sorted((json.loads(x) for x in lines if x), key=lambda e: float(e["t"]))


def _report(run_dir: Path) -> None:
    events = _events(run_dir)
    faults = [e for e in events if e["kind"] == "fault_injected"]
    for e in events:
        if e["kind"] != "resize":
            continue
        before = [f for f in faults if f["t"] <= e["t"]]
        cause = before[-1]["spec"] if before else "?"
        after = f"{e['t'] - before[-1]['t']:5.2f} s after `{cause}`" if before else ""
        print(
            f"  {e['reason']:<6} {e['from_world_size']} -> {e['world_size']} workers at step "
            f"{e['step']:>4}: {e['micro_batches']} micro-batch(es)/rank, global batch "
            f"{e['global_batch']}, lr {e['lr']:.4g}; survivors stopped {e['stall_s']:.3f} s"
            f"{'; ' + after if after else ''}"
        )
    received = [e for e in events if e["kind"] == "state_received"]
    for e in received:
        print(
            f"  member {e['rank']} received step {e['step']} from a survivor's memory: "
            f"{e['bytes'] / 1e6:.1f} MB in {e['transfers']} transfer(s), xxh3 "
            f"{'matches' if e['digest'] == e['sender_digest'] else 'DIFFERS'}"
        )


def main(args: argparse.Namespace, run_job: Callable[..., float]) -> int:
    s = min(args.steps, 600)
    out = Path(args.out_dir) / "elastic"
    out.mkdir(parents=True, exist_ok=True)
    train = ["--steps", str(s), "--step-sleep", "0.01"]
    chaos = (
        f"kill rank=3 at=step:{s // 5} permanent; kill node=1 at=step:{2 * s // 5} permanent; "
        f"join node=1 at=step:{3 * s // 5}"
    )
    tag = " ".join([*train, *LAUNCH]).encode()
    key = hashlib.sha256(EXAMPLE.read_bytes() + tag).hexdigest()[:12]
    ref_dir = out / f"reference-{key}"
    print(
        "stalwart elastic demo: 2 nodes x 2 workers (gloo on CPU), global batch 48 kept "
        "constant, --strategy elastic --nnodes 1:2 --nproc-per-node 1:2"
    )
    if args.fresh or not (ref_dir / "trace").exists():
        print("[1/2] fixed 4-worker run ...", end=" ", flush=True)
        shutil.rmtree(ref_dir, ignore_errors=True)
        ref_dir.mkdir(parents=True)
        took = run_job(
            ref_dir / "run",
            [*train, "--trace", str(ref_dir / "trace")],
            None,
            ref_dir / "final.pt",
            example=EXAMPLE,
            launch=LAUNCH,
        )
        print(f"{took:.1f} s")
    else:
        print(f"[1/2] fixed 4-worker run: cached ({ref_dir})")
    print(f"[2/2] elastic run with chaos: {chaos}", flush=True)
    run = out / "run"
    shutil.rmtree(out / "trace", ignore_errors=True)
    took = run_job(
        run,
        [*train, "--trace", str(out / "trace")],
        chaos,
        out / "final.pt",
        example=EXAMPLE,
        launch=LAUNCH,
    )
    print(f"  finished in {took:.1f} s; run dir {run}")
    _report(run)
    ref, got = _trace(ref_dir), _trace(out)
    same_samples = ref.keys() == got.keys() and all(ref[k][1] == got[k][1] for k in ref)
    worst = max(abs(got[k][0] - ref[k][0]) / abs(ref[k][0]) for k in ref if k in got)
    first = next(e["step"] for e in _events(run) if e["kind"] == "resize")
    exact = all(got[k][0] == ref[k][0] for k in ref if k <= first)
    worlds = [got[k][2] for k in sorted(got)]
    path = [worlds[0]] + [w for a, w in itertools.pairwise(worlds) if w != a]
    print(f"  world sizes: {' -> '.join(map(str, path))} (no survivor process restarted)")
    print(f"  same samples in every optimizer step as the fixed run: {same_samples}")
    print(f"  losses of steps 1..{first} (before the first resize) bit-identical: {exact}")
    steps = sorted(ref)
    windows = [steps[i : i + WINDOW] for i in range(0, len(steps), WINDOW)]
    curve = max(
        abs(sum(got[k][0] for k in w) - sum(ref[k][0] for k in w)) / sum(ref[k][0] for k in w)
        for w in windows
    )
    ok = same_samples and curve <= TOLERANCE
    print(
        f"verdict: loss curve {'MATCHES' if ok else 'DIFFERS FROM'} the fixed 4-worker run "
        f"({WINDOW}-step means within {curve:.1e}, tolerance {TOLERANCE:.0e}; largest "
        f"single-step difference {worst:.1e})"
    )
    print(f"details: stalwart report {run}")
    return 0 if ok else 1
