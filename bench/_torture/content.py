"""Constants, the run's config, and the deterministic content every step must hold."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

KEEP_LAST = 2
EXTRA_ELEMS = 3000  # float32 leaf that changes every step
PHASES = ("start", "fill", "write", "commit", "gc")
AIMED = ("write", "commit", "gc")
MODES = ("uniform", "delay", "op")
START_TIMEOUT_S = 60.0  # a child that is not ready by then is reported (loaded machine)
EVENT_TIMEOUT_S = 60.0  # an aimed-at phase that never starts is reported


@dataclass(frozen=True)
class TortureConfig:
    instants: int = 200
    seed: int = 0
    ranks: int = 2
    rank_bytes: int = (3 << 20) // 2 + 4321  # ~3 MB per step; last chunk is partial
    chunk_bytes: int = 64 << 10
    root: str | None = None  # checkpoint directory; a fresh temp dir by default
    keep_root: bool = False
    clean_steps: int = KEEP_LAST + 1  # after the last kill: then nothing may be left over
    inject_bug: str | None = None  # break the engine on purpose (tests of the harness)


# --------------------------------------------------------------------------- content


def chunk_period(i: int) -> int:
    return i % 4 + 1


@functools.lru_cache(maxsize=512)
def _chunk(seed: int, rank: int, i: int, version: int, length: int) -> bytes:
    return hashlib.shake_128(f"stalwart-torture:{seed}:{rank}:{i}:{version}".encode()).digest(
        length
    )


def expected_blob(seed: int, step: int, rank: int, nbytes: int, chunk_bytes: int) -> bytes:
    """The blob of ``rank`` at ``step``: chunk ``i`` changes every ``i % 4 + 1`` steps."""
    parts = []
    for i, start in enumerate(range(0, nbytes, chunk_bytes)):
        length = min(chunk_bytes, nbytes - start)
        parts.append(_chunk(seed, rank, i, step // chunk_period(i), length))
    return b"".join(parts)


def expected_extra(seed: int, step: int, rank: int) -> bytes:
    return _chunk(seed, rank, -1, step, EXTRA_ELEMS * 4)


def expected_info(step: int, rank: int) -> dict[str, int]:
    return {"step": step, "rank": rank}


def _extra_offset(rank_bytes: int) -> int:
    return (rank_bytes + 63) // 64 * 64


def slot_tree_and_layout(step: int, rank: int, rank_bytes: int) -> tuple[Any, list[Any], int]:
    """What the snapshotter would record for ``{"blob", "extra", "info"}`` (tagged JSON
    tree, tensor layout in the slot, slot size), built without torch."""
    tree = {
        "t": "dict",
        "items": [
            ["blob", {"t": "tensor", "id": 0}],
            ["extra", {"t": "tensor", "id": 1}],
            ["info", {"t": "dict", "items": [["step", step], ["rank", rank]]}],
        ],
    }
    off = _extra_offset(rank_bytes)
    layout = [
        {"id": 0, "path": ".blob", "dtype": "uint8", "shape": [rank_bytes]},
        {"id": 1, "path": ".extra", "dtype": "float32", "shape": [EXTRA_ELEMS]},
    ]
    layout[0].update(nbytes=rank_bytes, offset=0, shard=None, ndarray=False)
    layout[1].update(nbytes=EXTRA_ELEMS * 4, offset=off, shard=None, ndarray=False)
    return tree, layout, off + EXTRA_ELEMS * 4
