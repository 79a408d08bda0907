"""A part of a snapshot: some of its top-level names, with only their tensors.

The per-rank part of a replicated (DDP) job's state (RNG, loader, tracked values: see
runtime/state/_perrank.py) is persisted by every rank from the rank's own snapshot slot; the
persister writes only these entries. No torch here: the persister process imports none.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from stalwart.errors import CheckpointFormatError

__all__ = ["select"]


def _ids(node: Any, out: set[int]) -> None:
    if isinstance(node, dict):
        if node.get("t") in ("tensor", "ndarray"):
            out.add(int(node["id"]))
            return
        for value in node.get("items", []):
            _ids(value, out)
    elif isinstance(node, list):
        for value in node:
            _ids(value, out)


def select(
    tree: Any, layout: list[dict[str, Any]], names: Collection[str]
) -> tuple[Any, list[dict[str, Any]]]:
    """The tree of the top-level entries ``names`` and the layout entries of their
    tensors (ids kept: the tree refers to them)."""
    if not isinstance(tree, dict) or tree.get("t") != "dict":
        raise CheckpointFormatError("snapshot tree is not a mapping of names; snapshot again")
    items = [item for item in tree["items"] if item[0] in names]
    missing = set(names) - {item[0] for item in items}
    if missing:
        raise CheckpointFormatError(
            f"snapshot has no entry {', '.join(sorted(missing))}; track it before snapshotting"
        )
    ids: set[int] = set()
    _ids(items, ids)
    return {"t": "dict", "items": items}, [e for e in layout if int(e["id"]) in ids]
