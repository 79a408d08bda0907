#!/usr/bin/env python3
"""Crash-consistency torture for the checkpoint engine: SIGKILL the persister, then check.

The driver starts a child process (this file with ``--child``; it imports no torch, so it
starts in ~0.15 s) that saves step after step, forever, continuing from the newest
committed step + 1. Each step it builds a deterministic state for every rank in a
shared-memory slot and calls :func:`stalwart.checkpoint._persist_worker.handle_persist`
exactly as the persister process does (the last rank commits, then GC runs with
``keep_last=2``, so garbage collection deletes steps and shared packs all the time).

The driver SIGKILLs the child at a random instant, reaps it, and checks the storage:

- the newest committed step verifies (``verify_step``, deep), and ``restore_state`` loads
  it (not an older one) with every rank's bytes equal to the recomputed expected content;
- every other visible committed step verifies and restores bit-exactly as well
  ("committed and verifiable, or invisible");
- no committed step goes backwards: a step seen committed may only vanish when at least
  ``keep_last`` newer committed steps exist (retention). (Each kill inside a GC may
  leave one more old step behind; the next complete GC removes it, see below.)

Kill instants, three kinds, shuffled so that every 10 instants hold 4 ``uniform`` ones and
one of each aimed kind per phase:

- ``uniform``: the driver kills at a uniform time over a window of a few steps after the
  child is ready;
- ``delay``: aimed at a phase (rank write, commit, GC), which the child reports on stdout
  as it starts: the driver kills a random fraction of that phase's typical duration after
  its n-th start;
- ``op``: the child SIGKILLs itself just before its k-th storage mutation (file create,
  write, rename, atomic write, delete) inside the n-th run of a phase, so a crash between
  any two file operations of a commit or a GC is hit, not only the instants a timer can
  reach (a commit or a GC takes about a millisecond here).

The phase that was really interrupted is the last one the child reported before it died.

State: per rank, ``{"blob": uint8[rank_bytes], "extra": float32[3000], "info": {...}}``.
Chunk ``i`` of the blob changes every ``i % 4 + 1`` steps, so later steps reference
chunks of packs written by earlier ones, and a pack dies only when all its chunks have
changed: GC of shared packs is exercised. ``extra`` changes every step, at a slot offset
that is not chunk-aligned.

After the last instant, a few clean steps run and the storage must hold nothing that no
committed step references (no pack, temp file or step directory leaked by a crash).

Usage: ``python bench/torture_checkpoint.py [--instants 200] [--seed 0]``; the last line
of output is JSON: ``{"instants", "failures", "committed_steps_seen", "seconds", ...}``.
Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_torture

from _torture.check import Tracker, check_storage
from _torture.child import INJECTABLE_BUGS, child_main
from _torture.content import AIMED, TortureConfig
from _torture.driver import KillPlan, format_summary, kill_once, run_torture, save_steps

__all__ = [
    "KillPlan",
    "TortureConfig",
    "Tracker",
    "check_storage",
    "kill_once",
    "main",
    "run_torture",
    "save_steps",
]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="SIGKILL the checkpoint persister at random instants (save, commit, "
        "GC) and check after each kill that the latest committed checkpoint verifies and "
        "restores bit-exactly."
    )
    p.add_argument("--instants", type=_positive, default=200, help="kills (default 200)")
    p.add_argument("--seed", type=int, default=0, help="random seed (kill plan and content)")
    p.add_argument("--ranks", type=_positive, default=2, help="ranks per step (default 2)")
    p.add_argument("--rank-bytes", type=_positive, default=TortureConfig.rank_bytes)
    p.add_argument("--chunk-bytes", type=_positive, default=TortureConfig.chunk_bytes)
    p.add_argument("--root", help="checkpoint directory (default: a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    p.add_argument(
        "--inject-bug",
        choices=INJECTABLE_BUGS,
        help="break the engine on purpose, to see the torture catch it",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shm-dir", help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--die-in", choices=AIMED, help=argparse.SUPPRESS)
    p.add_argument("--die-nth", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--die-op", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.root and os.path.exists(args.root) and os.listdir(args.root):
        p.error(f"--root {args.root} is not empty; pass a new directory")
    cfg = TortureConfig(
        instants=args.instants,
        seed=args.seed,
        ranks=args.ranks,
        rank_bytes=args.rank_bytes,
        chunk_bytes=args.chunk_bytes,
        root=args.root,
        keep_root=args.keep,
        inject_bug=args.inject_bug,
    )
    summary = run_torture(cfg, progress=sys.stderr)
    for f in summary.failed:
        print(f"FAILED instant {f['instant']} ({f['phase']}, step {f['step']}):")
        for problem in f["problems"][:10]:
            print(f"    {problem}")
    print(format_summary(summary, cfg))
    out = asdict(summary)
    del out["failed"]
    print(json.dumps(out))
    return 1 if summary.failures or summary.leaked_files or summary.child_imported_torch else 0


if __name__ == "__main__":
    sys.exit(main())
