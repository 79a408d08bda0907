"""The live-nodes digest: the job's live and departed node ids as ranges, in one key.

Format (version 1; docs/wire-protocol.md, "The live-nodes digest")::

    {"v": 1, "by": k, "live": [[a, b], ...], "left": [[a, b], ...]}

``by`` is the node that wrote it; ``live`` the node ids with a member key; ``left`` the
ids that joined (``joined/node<k>``) and have none (a goodbye or a loss: the adopter
tells them apart). Each list holds inclusive ranges ``[a, b]``, ``0 <= a <= b < 2^31``,
ascending and disjoint, at most 65,536 ranges and 2^20 ids per list. Ranges keep a
job's usual ids (0..N-1, a few gaps) to a few bytes whatever N is: the digest is what
N agents receive at every change.

A digest is checked field by field before use; :func:`parse_digest` answers ``None`` for
anything else (and the reader reads the membership itself).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["LiveDigest", "encode_digest", "parse_digest"]

VERSION = 1
MAX_ID = 2**31 - 1
MAX_RANGES = 65_536  # per list: ids this scattered are not a job's nodes
MAX_IDS = 1 << 20  # per list: a [0, 2^31) range must not expand into 2^31 ints
MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class LiveDigest:
    by: int
    live: frozenset[int]
    left: frozenset[int]


def _ranges(ids: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for n in sorted(ids):
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


def encode_digest(by: int, live: Iterable[int], left: Iterable[int]) -> bytes:
    """The digest's bytes (compact JSON; equal sets give equal bytes)."""
    record = {"v": VERSION, "by": by, "live": _ranges(live), "left": _ranges(left)}
    return json.dumps(record, separators=(",", ":")).encode()


def _is_id(x: Any) -> bool:
    return type(x) is int and 0 <= x <= MAX_ID


def _ids(raw: Any) -> frozenset[int] | None:
    if not isinstance(raw, list) or len(raw) > MAX_RANGES:
        return None
    out: set[int] = set()
    last = -1
    for pair in raw:
        if not isinstance(pair, list) or len(pair) != 2:
            return None
        a, b = pair
        if not (_is_id(a) and _is_id(b)) or a > b or a <= last:
            return None
        if len(out) + b - a + 1 > MAX_IDS:
            return None
        out.update(range(a, b + 1))
        last = b
    return frozenset(out)


def parse_digest(raw: bytes) -> LiveDigest | None:
    """The digest in ``raw``, or None for anything malformed (never raises)."""
    if len(raw) > MAX_BYTES:
        return None
    try:
        record = json.loads(raw, parse_constant=_reject)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or set(record) != {"v", "by", "live", "left"}:
        return None
    if type(record["v"]) is not int or record["v"] != VERSION or not _is_id(record["by"]):
        return None
    live, left = _ids(record["live"]), _ids(record["left"])
    if live is None or left is None or live & left:
        return None
    return LiveDigest(record["by"], live, left)


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
