"""Fuzzing the manifest and rank-index decoders: whatever the bytes (valid checksums
included), only CheckpointFormatError escapes, and what decodes is within bounds."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.checkpoint.format import ChunkRef, IndexRef, Manifest, RankIndex, TensorEntry
from stalwart.checkpoint.format import checksum as xxh
from stalwart.errors import CheckpointFormatError

PACK = "data/000000000007-r00000-abcd1234.pack"
FUZZ = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 64), max_value=1 << 64)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["../x", "/etc/passwd", PACK, "float99", "tensor", "dict"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _index_doc() -> dict[str, Any]:
    t = TensorEntry(0, ".w", "float32", [2, 2], 16, [ChunkRef("ab" * 16, PACK, 0, 16)])
    return json.loads(RankIndex(7, 0, 1, {"t": "tensor", "id": 0}, [t]).encode())


def _manifest_doc() -> dict[str, Any]:
    m = Manifest(
        7, 1, [IndexRef(0, "step_000000000007/rank_00000.json", "cd" * 16, 10)], [PACK], 16, 16, 1.0
    )
    return json.loads(m.encode())


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def _resign(doc: Any) -> bytes:
    """Recompute a manifest's checksum so that only field validation can refuse it."""
    if isinstance(doc, dict) and "checksum" in doc:
        body = {k: v for k, v in doc.items() if k != "checksum"}
        try:
            canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
            doc["checksum"] = xxh(canon.encode())
        except (TypeError, ValueError):
            pass
    return json.dumps(doc).encode()


def _decodes_or_format_error(decode: Any, raw: bytes) -> Any:
    try:
        return decode(raw, "fuzz")
    except CheckpointFormatError as err:
        assert str(err) and "\n" not in str(err)
        return None


@FUZZ
@given(st.data(), json_values)
def test_mutated_manifest(data: st.DataObject, value: Any) -> None:
    doc = _manifest_doc()
    path = data.draw(st.sampled_from(_paths(doc)))
    m = _decodes_or_format_error(Manifest.decode, _resign(_mutate(doc, path, value)))
    if m is not None:
        assert len(m.indexes) == m.world_size and 0 <= m.created_unix < 1e11
        assert all(p.startswith("data/") and ".." not in p for p in m.packs)


@FUZZ
@given(st.data(), json_values)
def test_mutated_rank_index(data: st.DataObject, value: Any) -> None:
    doc = _index_doc()
    path = data.draw(st.sampled_from(_paths(doc)))
    idx = _decodes_or_format_error(RankIndex.decode, json.dumps(_mutate(doc, path, value)).encode())
    if idx is not None:
        for t in idx.tensors:
            assert sum(c.length for c in t.chunks) == t.nbytes
            assert all(c.offset >= 0 and c.pack.startswith("data/") for c in t.chunks)


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes(raw: bytes) -> None:
    _decodes_or_format_error(Manifest.decode, raw)
    _decodes_or_format_error(RankIndex.decode, raw)


def test_deep_nesting_is_a_format_error() -> None:
    deep = b'{"format":"stalwart.rank-index","version":1,"tree":' + b"[" * 100_000
    assert _decodes_or_format_error(RankIndex.decode, deep + b"]" * 100_000 + b"}") is None


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
        lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
    )
)
def test_slot_metadata_of_any_shape_is_refused_not_raised(doc: Any) -> None:
    """A slot's metadata file is read by survivors, standbys and the replica receiver: a
    torn or crafted one is 'no slot here' (None), never an exception."""
    from stalwart.checkpoint.slots import SLOT_FORMAT, SLOT_VERSION, SlotMeta

    for data in (json.dumps(doc).encode(), b"[" * 100_000, b'{"seq": 1e400}'):
        SlotMeta.decode(data)
    crafted = {
        "format": SLOT_FORMAT,
        "version": SLOT_VERSION,
        "seq": doc,
        "step": doc,
        "tree": doc,
        "layout": doc,
        "data_size": doc,
        "extra": doc,
    }
    meta = SlotMeta.decode(json.dumps(crafted).encode())
    assert meta is None or isinstance(meta.seq, int)
