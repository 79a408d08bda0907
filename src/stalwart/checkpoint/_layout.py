"""A step's shard layout, checked across its ranks before any byte is used.

Each rank index is validated on its own when decoded (format.py); what only the whole
step can say is checked here (docs/checkpoint-format.md, "Validation"):

* every ``copy_of`` entry (an HSDP replica's shard without bytes) names another rank
  whose index holds a stored piece (not itself a copy) of the same tensor, dtype and
  box: a chain resolves in one step, so it cannot loop, and a self-copy is refused;
* the stored pieces of a sharded tensor agree on dtype and global shape, and their
  distinct boxes tile the global shape exactly: no two overlap (identical boxes are
  replicas and count once) and together they cover every element, so an assembled or
  resharded tensor holds only bytes that were written.

Problems are one line each; callers report them (verify), skip the step (restore) or
refuse it (export) as for any corrupt step.
"""

from __future__ import annotations

from stalwart.checkpoint import _validate as v
from stalwart.checkpoint.format import RankIndex, TensorEntry

__all__ = ["layout_problems"]

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def _box(t: TensorEntry) -> _Box:
    offsets = tuple(t.shard["offsets"]) if t.shard else (0,) * len(t.shape)
    return offsets, tuple(t.shape)


def layout_problems(indexes: list[RankIndex]) -> list[str]:
    """What is wrong with the layout of a step whose every rank index is ``indexes``."""
    problems: list[str] = []
    stored: dict[int, dict[str, list[TensorEntry]]] = {}
    pieces: dict[str, list[TensorEntry]] = {}
    for index in indexes:
        mine = stored.setdefault(index.rank, {})
        for t in index.tensors:
            if t.copy_of is None:
                mine.setdefault(t.path, []).append(t)
                if t.shard is not None:
                    pieces.setdefault(t.path, []).append(t)
    for index in indexes:
        for t in index.tensors:
            if t.copy_of is not None:
                problem = _copy_problem(index.rank, t, stored)
                if problem:
                    problems.append(problem)
    for path, parts in pieces.items():
        problem = _tiling_problem(path, parts)
        if problem:
            problems.append(problem)
    return problems


def _copy_problem(
    rank: int, t: TensorEntry, stored: dict[int, dict[str, list[TensorEntry]]]
) -> str:
    where = f"rank {rank}: tensor {t.path[:80]!r}"
    if t.copy_of == rank:
        return f"{where} is a copy of itself; the index is damaged"
    if t.copy_of not in stored:
        return f"{where} is a copy of rank {t.copy_of}, whose index is not in the step"
    for s in stored[t.copy_of].get(t.path, []):
        if s.dtype == t.dtype and _box(s) == _box(t) and s.shard == t.shard:
            return ""
    return (
        f"{where} is a copy of rank {t.copy_of}, which stores no piece of that tensor, "
        "dtype and box; the index is damaged"
    )


def _tiling_problem(path: str, parts: list[TensorEntry]) -> str:
    where = f"tensor {path[:80]!r}"
    first = parts[0]
    assert first.shard is not None
    glob = first.shard["global_shape"]
    if any(p.dtype != first.dtype or (p.shard or {}).get("global_shape") != glob for p in parts):
        return f"{where}: its shards disagree on dtype or global shape; the step is damaged"
    boxes = sorted({_box(p) for p in parts})  # by their first offset
    for i, a in enumerate(boxes):
        # a sweep along dim 0: only boxes starting before ``a`` ends there can overlap it
        for b in boxes[i + 1 :]:
            if a[0] and b[0][0] >= a[0][0] + a[1][0]:
                break
            if _overlap(a, b):
                return (
                    f"{where}: shard boxes at {list(a[0])[:8]} and {list(b[0])[:8]} overlap; "
                    "the step is damaged"
                )
    if sum(v.numel(list(shape)) for _, shape in boxes) != v.numel(glob):
        return (
            f"{where}: its shards do not cover the global shape {glob[:8]}; "
            "the checkpoint is missing ranks"
        )
    return ""


def _overlap(a: _Box, b: _Box) -> bool:
    return all(
        max(ao, bo) < min(ao + an, bo + bn)
        for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True)
    )
