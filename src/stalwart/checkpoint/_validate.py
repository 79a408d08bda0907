"""Bounds for every field of the checkpoint format, checked before any field is used.

A checkpoint may come from anywhere (a copied run directory, a crafted file whose
checksums are valid): decoding must turn every out-of-range value into one
:class:`CheckpointFormatError` that names the file and the field, never a raw Python
error, an allocation of 2^50 bytes or a read outside the root. No torch here: the table
below names the dtypes the format stores and their sizes.
"""

from __future__ import annotations

import math
import re
from typing import Any

from stalwart.errors import CheckpointFormatError

__all__ = [
    "DTYPE_SIZES",
    "MAX_CHUNK_BYTES",
    "MAX_RANKS",
    "MAX_STEP",
    "MAX_TENSOR_BYTES",
    "check_tree",
    "want_bool",
    "want_dict",
    "want_float",
    "want_hash",
    "want_int",
    "want_list",
    "want_pack",
    "want_shape",
    "want_str",
]

MAX_STEP = 10**12 - 1  # step directories have 12 digits
MAX_RANKS = 1 << 20
MAX_GENERATION = 1 << 62
MAX_CHUNK_BYTES = 1 << 30
"""A chunk is read into one buffer (verify: one per thread); writers use 4 MiB."""
MAX_TENSOR_BYTES = 1 << 44
MAX_FILE_BYTES = 1 << 50
MAX_DIMS = 64
MAX_UNIX = 1e11  # seconds since 1970: about the year 5138
MAX_INDEX_BYTES = 1 << 34

DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4,
    "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}  # fmt: skip

_HASH_RE = re.compile(r"^[0-9a-f]{32}$")
_PACK_RE = re.compile(r"^data/\d{12}-r\d{5}-[0-9a-z]{1,32}\.pack$")
_TREE_TAGS = frozenset({"dict", "list", "tuple", "tensor", "ndarray", "float", "bytes", "dtype"})
_B64_RE = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")


def _bad(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{where}: {what}; the file is damaged or crafted: use an earlier checkpoint"
    )


def want_dict(v: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(where, f"{what} is not an object")
    return v


def want_list(v: Any, where: str, what: str, max_len: int = 1 << 24) -> list[Any]:
    if not isinstance(v, list) or len(v) > max_len:
        raise _bad(where, f"{what} is not a list of at most {max_len} items")
    return v


def want_int(v: Any, where: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(where, f"{what} = {str(v)[:40]!r} is not an integer in [{lo}, {hi}]")
    return v


def want_float(v: Any, where: str, what: str, lo: float, hi: float) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(where, f"{what} = {str(v)[:40]!r} is not a number in [{lo:g}, {hi:g}]")
    return float(v)


def want_bool(v: Any, where: str, what: str) -> bool:
    if type(v) is not bool:
        raise _bad(where, f"{what} = {str(v)[:40]!r} is not true or false")
    return v


def want_str(v: Any, where: str, what: str, max_len: int = 4096) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise _bad(where, f"{what} is not a string of at most {max_len} characters")
    return v


def want_hash(v: Any, where: str, what: str) -> str:
    if not isinstance(v, str) or not _HASH_RE.match(v):
        raise _bad(where, f"{what} = {str(v)[:40]!r} is not an xxh3-128 hex digest")
    return v


def want_pack(v: Any, where: str) -> str:
    """A pack name: ``data/<12 digits>-r<5 digits>-<nonce>.pack``, nothing else (so it
    can neither leave the root nor name another kind of file)."""
    if not isinstance(v, str) or not _PACK_RE.match(v):
        raise _bad(where, f"pack {str(v)[:80]!r} is not a pack name under data/")
    return v


def want_shape(v: Any, where: str, what: str) -> list[int]:
    dims = want_list(v, where, what, MAX_DIMS)
    return [want_int(d, where, f"{what}[{i}]", 0, MAX_TENSOR_BYTES) for i, d in enumerate(dims)]


def numel(shape: list[int]) -> int:
    return math.prod(shape)


def check_tree(tree: Any, ids: set[int], where: str) -> None:
    """Every node of a state tree (see ``_tree.py``) is well formed and every tensor it
    references is in the index: decoding it can then not fail. Iterative, so depth costs
    no recursion."""
    stack: list[tuple[Any, bool]] = [(tree, False)]
    count = 0
    while stack:
        node, is_key = stack.pop()
        count += 1
        if count > 1 << 24:
            raise _bad(where, "the state tree has more than 2^24 nodes")
        if node is None or isinstance(node, bool | int | str):
            continue
        if isinstance(node, float):
            if not math.isfinite(node):
                raise _bad(where, "the state tree holds a bare non-finite number")
            continue
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise _bad(where, f"malformed state tree node {str(node)[:60]!r}")
        if node["t"] not in _TREE_TAGS:
            raise _bad(where, f"malformed state tree node {str(node)[:60]!r}")
        tag = node["t"]
        if tag in ("list", "tuple"):
            stack.extend((v, is_key) for v in want_list(node.get("items"), where, "tree items"))
        elif tag == "dict":
            if is_key:
                raise _bad(where, "a dict used as a dict key in the state tree")
            for pair in want_list(node.get("items"), where, "tree items"):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _bad(where, "a dict item of the state tree is not a [key, value] pair")
                stack.append((pair[0], True))
                stack.append((pair[1], False))
        elif tag in ("tensor", "ndarray"):
            if is_key or want_int(node.get("id"), where, "tree tensor id") not in ids:
                raise _bad(where, f"the state tree references unknown tensor {node.get('id')!r}")
        elif tag == "float":
            if node.get("v") not in ("nan", "inf", "-inf"):
                raise _bad(where, f"tree float {str(node.get('v'))[:20]!r} is not nan/inf/-inf")
        elif tag == "bytes":
            b64 = want_str(node.get("b64"), where, "tree bytes", 1 << 30)
            if len(b64) % 4 or not _B64_RE.match(b64):
                raise _bad(where, "tree bytes are not base64")
        elif not isinstance(node.get("v"), str) or node["v"] not in DTYPE_SIZES:  # dtype
            raise _bad(where, f"unknown dtype {str(node.get('v'))[:20]!r} in the state tree")
