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
   started before the newest commit may be deduplicating against;
4. nothing outside the root is touched: the storage never follows a link, and a linked
   ``step_*``, ``data/`` or pack is reported (``GcReport.skipped``) and left alone.

GC runs in the committer right after a commit; at most one checkpoint is in flight per
job (the same rule torch's async_save has).
"""

from __future__ import annotations

from collections.abc import Collection
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
from stalwart.contract.env import DEFAULTS
from stalwart.errors import CheckpointFormatError, ConfigError

__all__ = ["GcReport", "RetentionPolicy", "collect_garbage"]


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed steps, and every step divisible by
    ``keep_every`` (e.g. 1000 to keep a long-term history). The default of
    ``keep_last`` is the worker contract's (``--keep-last``), stated there only."""

    keep_last: int = DEFAULTS.keep_last
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
    deleted_steps: list[int] = field(default_factory=list)  # committed steps removed
    deleted_partial: list[int] = field(default_factory=list)  # uncommitted leftovers removed
    deleted_packs: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # entries left alone, and why

    def summary(self) -> str:
        line = (
            f"deleted {len(self.deleted_steps)} checkpoint(s) {self.deleted_steps}, "
            f"{len(self.deleted_partial)} uncommitted step dir(s), "
            f"{len(self.deleted_packs)} pack file(s), freed {self.freed_bytes} bytes"
        )
        if self.skipped:
            line += f"; left {len(self.skipped)} entr(ies) alone: {'; '.join(self.skipped[:3])}"
        return line


def collect_garbage(
    storage: Storage, policy: RetentionPolicy, *, protect: Collection[int] = ()
) -> GcReport:
    """Apply ``policy``; ``protect`` names steps kept whatever the policy says (a step
    another member may still restore from). Never follows a link: a linked ``step_*``,
    ``data/`` or pack is reported in ``skipped`` and left alone."""
    report = GcReport()
    manifests, all_steps = _read_steps(storage, report)
    if not manifests:
        return report
    newest = max(manifests)
    kept = policy.keep(list(manifests)) | {s for s in protect if s in manifests}
    live: set[str] = set()
    for step in kept | set(sorted(manifests)[-2:]):
        m = manifests.get(step)
        if m is not None:
            live |= set(m.packs)

    for step in sorted(all_steps):
        if step in kept or step > newest:
            continue
        if _delete_step(storage, step, report):
            (report.deleted_steps if step in manifests else report.deleted_partial).append(step)
    _delete_packs(storage, newest, live, report)
    return report


def _read_steps(storage: Storage, report: GcReport) -> tuple[dict[int, Manifest | None], list[int]]:
    """The manifest of every step directory (None: damaged or not a file, so it protects
    nothing) and every step directory, committed or not; links are skipped."""
    manifests: dict[int, Manifest | None] = {}
    all_steps: list[int] = []
    for name in storage.listdir(""):
        step = parse_step_dir(name)
        if step is None:
            continue
        kind = storage.kind(name)
        if kind != "dir":
            report.skipped.append(f"{name}: a {kind}, not a step directory")
            continue
        all_steps.append(step)
        mkind = storage.kind(manifest_path(step))
        if mkind == "file":
            try:
                manifests[step] = Manifest.decode(storage.read(manifest_path(step)), name)
            except (CheckpointFormatError, OSError):
                manifests[step] = None  # damaged: unloadable, so it protects nothing
        elif mkind != "missing":
            manifests[step] = None
    return manifests, all_steps


def _delete_packs(storage: Storage, newest: int, live: set[str], report: GcReport) -> None:
    """Delete the packs no kept manifest references (a pack written for a step after
    ``newest`` may belong to a commit in flight: kept)."""
    data_kind = storage.kind("data")
    if data_kind not in ("dir", "missing"):
        report.skipped.append(f"data: a {data_kind}, not a directory; no pack collected")
        return
    for name in storage.listdir("data"):
        path = f"data/{name}"
        base = name.split(".", 1)[0] + ".pack" if name.endswith(".tmp") else name
        written_for = pack_step(base)
        if written_for is None or written_for > newest or path in live:
            continue
        kind = storage.kind(path)
        if kind != "file":
            report.skipped.append(f"{path}: a {kind}, not a pack file")
            continue
        try:
            size = storage.size(path)
            storage.delete(path)
        except (FileNotFoundError, CheckpointFormatError):
            continue
        report.freed_bytes += size
        report.deleted_packs.append(path)


def _delete_step(storage: Storage, step: int, report: GcReport) -> bool:
    """Manifest first (invisible), then the files, then the directory; True if it went."""
    d = step_dir(step)
    if storage.kind(f"{d}/{MANIFEST_NAME}") in ("file", "link"):
        storage.delete(f"{d}/{MANIFEST_NAME}")  # a link itself, never its target
    for name in storage.listdir(d):
        path = f"{d}/{name}"
        kind = storage.kind(path)
        if kind in ("file", "link"):
            storage.delete(path)  # unlinks a link itself: its target is never touched
        else:
            report.skipped.append(f"{path}: a {kind} inside a step directory")
    storage.delete_dir(d)
    return storage.kind(d) == "missing"
