"""Retention policy and garbage collection of unreferenced chunks.

Trade-off: chunks are shared between steps (incremental checkpoints), so deleting a step
may not free its bytes; a pack file is deleted only when no retained manifest references
any chunk in it. Packs are never rewritten (no compaction): a pack kept alive by one
frozen tensor keeps its other, dead bytes too. That wastes some space and buys a GC that
is safe against a crash at any instant:

1. a step is removed manifest first, so it turns invisible before anything it needs goes;
2. a pack is removed only when no remaining manifest references it;
3. packs and step directories newer than the newest commit belong to a save in flight
   and are left alone; so are the packs of the two newest manifests, which a save that
   started before the newest commit may be deduplicating against.

GC runs in the committer right after a commit; at most one checkpoint is in flight per
job (the same rule torch's async_save has).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stalwart.checkpoint.format import (
    MANIFEST_NAME,
    Manifest,
    manifest_path,
    pack_step,
    parse_step_dir,
    step_dir,
)
from stalwart.checkpoint.storage import Storage
from stalwart.errors import CheckpointFormatError, ConfigError

__all__ = ["GcReport", "RetentionPolicy", "collect_garbage"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed steps, and every step divisible by
    ``keep_every`` (e.g. 1000 to keep a long-term history)."""

    keep_last: int = 3
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"keep_last={self.keep_last}: keep at least 1 checkpoint")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"keep_every={self.keep_every}: use a positive step count or None")

    def keep(self, steps: list[int]) -> set[int]:
        ordered = sorted(steps)
        kept = set(ordered[-self.keep_last :])
        if self.keep_every:
            kept |= {s for s in ordered if s % self.keep_every == 0}
        return kept


@dataclass
class GcReport:
    deleted_steps: list[int] = field(default_factory=list)
    deleted_packs: list[str] = field(default_factory=list)
    freed_bytes: int = 0


def collect_garbage(storage: Storage, policy: RetentionPolicy) -> GcReport:
    report = GcReport()
    manifests: dict[int, Manifest | None] = {}
    all_steps: list[int] = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        all_steps.append(step)
        if storage.exists(manifest_path(step)):
            try:
                manifests[step] = Manifest.decode(storage.read(manifest_path(step)), name)
            except CheckpointFormatError:
                manifests[step] = None  # damaged: unloadable, so it protects nothing
    if not manifests:
        return report
    newest = max(manifests)
    kept = policy.keep(list(manifests))
    live: set[str] = set()
    for step in kept | set(sorted(manifests)[-2:]):
        m = manifests.get(step)
        if m is not None:
            live |= set(m.packs)

    for step in sorted(all_steps):
        if step in kept or step > newest:
            continue
        d = step_dir(step)
        storage.delete(f"{d}/{MANIFEST_NAME}")  # invisible first
        for name in storage.listdir(d):
            storage.delete(f"{d}/{name}")
        storage.delete_dir(d)
        if step in manifests:
            report.deleted_steps.append(step)

    for name in storage.listdir("data"):
        path = f"data/{name}"
        base = name.split(".", 1)[0] + ".pack" if name.endswith(".tmp") else name
        written_for = pack_step(base)
        if written_for is None or written_for > newest or path in live:
            continue
        try:
            report.freed_bytes += storage.size(path)
        except FileNotFoundError:
            continue
        storage.delete(path)
        report.deleted_packs.append(path)
    return report
