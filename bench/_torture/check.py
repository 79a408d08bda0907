"""After each kill: what the storage must hold (and must not)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from _torture.content import (
    EXTRA_ELEMS,
    KEEP_LAST,
    TortureConfig,
    expected_blob,
    expected_extra,
    expected_info,
)

# --------------------------------------------------------------------------- the checker


@dataclass
class Tracker:
    """What the checker has seen so far: steps must never go backwards."""

    last: list[int] = field(default_factory=list)  # committed steps at the previous check
    seen: set[int] = field(default_factory=set)  # every step ever seen committed


def check_storage(root: str, cfg: TortureConfig, tracker: Tracker) -> list[str]:
    """Every problem with the checkpoint directory after a kill (empty: all good)."""
    import torch

    from stalwart.checkpoint.catalog import committed_steps, verify_step
    from stalwart.checkpoint.restore import restore_state
    from stalwart.checkpoint.storage import open_storage
    from stalwart.errors import StalwartError

    storage = open_storage(root)
    problems: list[str] = []
    steps = committed_steps(storage)
    if tracker.last and not steps:
        problems.append(f"every committed step vanished (had {tracker.last})")
    if steps and tracker.last and steps[-1] < tracker.last[-1]:
        problems.append(f"newest committed step went backwards: {tracker.last[-1]} -> {steps[-1]}")
    for s in tracker.last:
        newer = [t for t in steps if t > s]
        if s not in steps and len(newer) < KEEP_LAST:
            problems.append(
                f"committed step {s} vanished with only {len(newer)} newer committed steps "
                f"(retention keeps the newest {KEEP_LAST})"
            )

    for s in steps:
        report = verify_step(storage, s, deep=True)
        if not report.ok:
            problems.extend(f"verify step {s}: {p}" for p in report.problems)

    def load(rank: int, step: int | None) -> tuple[int, list[str], dict[str, Any]]:
        state: dict[str, Any] = {
            "blob": torch.zeros(cfg.rank_bytes, dtype=torch.uint8),
            "extra": torch.zeros(EXTRA_ELEMS, dtype=torch.float32),
            "info": {},
        }
        res = restore_state(storage, state, rank=rank, world_size=cfg.ranks, step=step)
        return res.step, res.skipped, state

    for rank in range(cfg.ranks):
        for s in reversed(steps):
            latest = s == steps[-1]
            try:
                got, skipped, state = load(rank, None if latest else s)
            except StalwartError as err:
                problems.append(f"restore step {s} rank {rank}: {type(err).__name__}: {err}")
                continue
            if got != s or skipped:
                problems.append(
                    f"restore of the latest (step {s}) rank {rank} loaded step {got}"
                    + (f", skipping: {'; '.join(skipped[:3])}" if skipped else "")
                )
                continue
            blob = state["blob"].numpy().tobytes()
            want = expected_blob(cfg.seed, s, rank, cfg.rank_bytes, cfg.chunk_bytes)
            if blob != want:
                bad = next(i for i in range(len(want)) if blob[i] != want[i])
                problems.append(
                    f"restore step {s} rank {rank}: blob differs from the saved state "
                    f"(first at byte {bad}, chunk {bad // cfg.chunk_bytes})"
                )
            if state["extra"].view(torch.uint8).numpy().tobytes() != expected_extra(
                cfg.seed, s, rank
            ):
                problems.append(f"restore step {s} rank {rank}: 'extra' differs")
            if state["info"] != expected_info(s, rank):
                problems.append(f"restore step {s} rank {rank}: info {state['info']}")
    tracker.last = steps
    tracker.seen.update(steps)
    return problems


def leftovers(root: str) -> list[str]:
    """Files no committed step references (call after clean steps ran to their GC)."""
    from stalwart.checkpoint.catalog import committed_steps, load_manifest
    from stalwart.checkpoint.format import MANIFEST_NAME, index_path, parse_step_dir
    from stalwart.checkpoint.storage import open_storage

    storage = open_storage(root)
    steps = committed_steps(storage)
    wanted: set[str] = set()
    for s in steps:
        m = load_manifest(storage, s)
        wanted.update(m.packs)
        wanted.update(index_path(s, r) for r in range(m.world_size))
        wanted.add(f"step_{s:012d}/{MANIFEST_NAME}")
    present: set[str] = set()
    for name in storage.listdir(""):
        if name == "data" or parse_step_dir(name) is not None:
            present.update(f"{name}/{f}" for f in storage.listdir(name))
            if parse_step_dir(name) is not None and not storage.listdir(name):
                present.add(f"{name}/")
        else:
            present.add(name)
    return sorted(present - wanted)
