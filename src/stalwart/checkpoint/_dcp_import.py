"""The mechanics of importing a DCP checkpoint (the public entry is ``dcp.import_dcp``).

Safety first: DCP's ``.metadata`` is a plain pickle and DCP's stock planner loads every
non-tensor value with ``torch.load(weights_only=False)``. Here the metadata goes through
an unpickler that resolves only DCP's own metadata classes, and non-tensor values
through ``weights_only=True`` (plus numpy arrays, which RNG states contain); whatever is
refused is skipped and named, never executed.

Speed: every tensor is a view into one buffer laid out like a snapshot slot, so
``dcp.load`` fills the bytes that the pack writer then reads, with no copy between.
"""

from __future__ import annotations

import importlib
import itertools
import os
import pickle
import stat
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from stalwart.checkpoint._load import byte_view
from stalwart.checkpoint._tree import flatten
from stalwart.checkpoint._writer import publish_step, write_rank
from stalwart.checkpoint.format import step_dir
from stalwart.checkpoint.storage import Storage
from stalwart.compat.numpy_pickle import array_globals
from stalwart.compat.torch_dcp import METADATA_PRIVATE_GLOBALS
from stalwart.errors import CheckpointFormatError, ConfigError, UnsupportedStateError
from stalwart.userfile import open_regular

__all__ = ["METADATA_FILE", "Loaded", "load_nested", "read_metadata", "remove_written", "write"]

METADATA_FILE = ".metadata"
_ALIGN = 64  # offsets in the buffer: a view of any dtype is aligned

_FS = "torch.distributed.checkpoint.filesystem"
_PATHS = {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        *METADATA_PRIVATE_GLOBALS["torch.distributed.checkpoint.metadata"],
    },
    "torch.distributed.checkpoint.filesystem": {*METADATA_PRIVATE_GLOBALS[_FS]},
    "torch.serialization": {*METADATA_PRIVATE_GLOBALS["torch.serialization"]},
    "torch": {"Size"},
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes and torch dtypes: a ``.metadata`` file from
    elsewhere cannot run code by naming ``os.system`` or the like."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, set()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing {module}.{name}: not a DCP metadata class (only those are unpickled)"
        )


def read_metadata(src: str) -> Metadata:
    path = os.path.join(src, METADATA_FILE)
    try:
        fix = "pass a checkpoint written by torch.distributed.checkpoint.save"
        with open_regular(path, what="DCP's metadata", fix=fix) as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointFormatError(
            f"{path}: unreadable DCP metadata ({err}); pass a complete checkpoint written "
            "by torch.distributed.checkpoint.save"
        ) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    _check_data_files(src, metadata)
    return metadata


def _check_data_files(src: str, metadata: Metadata) -> None:
    """Every ``storage_data`` entry names a plain file directly in ``src`` (no ``/``,
    no ``..``, not a link): DCP joins ``relative_path`` to the directory as given, so a
    crafted ``.metadata`` could otherwise make it read any file on the machine."""
    storage_data = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage_data, dict):
        raise CheckpointFormatError(f"{src}: DCP metadata has malformed storage_data")
    for info in storage_data.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        ok = type(offset) is int and type(length) is int and offset >= 0 and length >= 0
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\x00" in rel:
            ok = False
        if not ok or not isinstance(rel, str):
            raise CheckpointFormatError(
                f"{src}: DCP metadata names data file {str(rel)[:80]!r} at {offset!r}+"
                f"{length!r}, outside the checkpoint directory or out of bounds; "
                "the .metadata file is damaged or crafted"
            )
        try:
            st = os.lstat(os.path.join(src, rel))
        except FileNotFoundError:
            continue  # DCP reports a missing file itself
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(
                f"{src}/{rel}: not a regular file (a link or directory); stalwart reads "
                "only plain files inside the DCP directory"
            )


class _SafeReader(FileSystemReader):
    """Hands out the metadata the safe unpickler read (the stock ``read_metadata`` is a
    plain ``pickle.load``); tensor data is read by DCP with ``weights_only=True``."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return self._metadata


def _numpy_globals() -> list[Any]:
    """What a pickled numpy array or scalar names (numpy RNG state holds one)."""
    return array_globals()


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``weights_only=True`` (the stock planner does not)
    and records what is refused instead of failing the whole import."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.skipped: dict[str, str] = {}
        self._numpy = _numpy_globals()

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals(self._numpy):
                self.state_dict[fqn] = torch.load(value, weights_only=True)
        except Exception as err:  # whatever weights_only refuses is skipped, by name
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            hit = [ln for ln in lines if "Unsupported global" in ln or "Can only build" in ln]
            why = (hit or lines or [""])[0]
            self.skipped[fqn] = f"not loadable with weights_only ({why[:160]})"


Path = tuple[str | int, ...]


@dataclass
class Loaded:
    """A DCP checkpoint as the nested state stalwart writes, plus the tensor buffer."""

    root: dict[str, Any]
    buf: torch.Tensor
    offset_of: dict[int, int]  # id(tensor view) -> byte offset in buf
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    other_values: int = 0


def load_nested(
    src: str, metadata: Metadata, include: Collection[str] | None, flat_into: str
) -> Loaded:
    paths = _final_paths(metadata, flat_into)
    grouped = sum(1 for k, p in paths.items() if len(p) == 2 and p == (flat_into, k))
    names = sorted({str(p[0]) for p in paths.values()})
    if include is not None:
        unknown = sorted(set(include) - set(names))
        if unknown:
            raise ConfigError(
                f"{src}: no top-level name(s) {', '.join(unknown)} in the checkpoint "
                f"(it has: {', '.join(names)})"
            )
        paths = {k: p for k, p in paths.items() if p[0] in include}
    flat, buf, offset_of = _allocate(metadata, paths)
    planner = _SafeLoadPlanner()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp_load(flat, storage_reader=_SafeReader(src, metadata), planner=planner, no_dist=True)
    loaded = Loaded({}, buf, offset_of)
    if grouped and flat_into in {p[0] for p in paths.values()}:
        loaded.notes.append(f"{grouped} top-level tensors grouped under {flat_into!r}")
    for fqn, path in paths.items():
        if fqn in planner.skipped:
            loaded.skipped.append(f"{fqn}: {planner.skipped[fqn]}")
            continue
        value = planner.state_dict[fqn]  # the tensor view, or what load_bytes decoded
        if not isinstance(value, torch.Tensor):
            try:
                flatten(value)
            except UnsupportedStateError as err:
                what = str(err).split(":", 1)[0]
                loaded.skipped.append(f"{fqn}: {what} (stalwart's format stores no pickle)")
                continue
            loaded.other_values += 1
        _set_path(loaded.root, path, value, fqn)
    _int_optimizer_keys(loaded.root)
    return loaded


def _final_paths(metadata: Metadata, flat_into: str) -> dict[str, Path]:
    """DCP key -> path in the nested state, from ``planner_data`` (the path ``dcp.save``
    flattened); dict keys come back as strings, list positions as ints."""
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths: dict[str, Path] = {}
    for fqn in metadata.state_dict_metadata:
        raw = planner_data.get(fqn)
        path = tuple(raw) if isinstance(raw, tuple | list) and raw else (fqn,)
        paths[fqn] = tuple(x if isinstance(x, int) else str(x) for x in path)
    nested = {p[0] for p in paths.values() if len(p) > 1}
    if flat_into not in nested:
        for fqn, p in paths.items():
            md = metadata.state_dict_metadata[fqn]
            if len(p) == 1 and isinstance(md, TensorStorageMetadata):
                paths[fqn] = (flat_into, p[0])
    return paths


def _allocate(
    metadata: Metadata, paths: dict[str, Path]
) -> tuple[dict[str, Any], torch.Tensor, dict[int, int]]:
    sizes: list[tuple[str, TensorStorageMetadata, int, int]] = []
    pos = 0
    for fqn in paths:
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata):
            nbytes = md.size.numel() * md.properties.dtype.itemsize
            sizes.append((fqn, md, pos, nbytes))
            pos += _aligned(nbytes)
    buf = torch.empty(pos, dtype=torch.uint8)
    flat: dict[str, Any] = dict.fromkeys(paths)
    offset_of: dict[int, int] = {}
    for fqn, md, off, nbytes in sizes:
        view = buf[off : off + nbytes].view(md.properties.dtype).view(md.size)
        flat[fqn] = view
        offset_of[id(view)] = off
    return flat, buf, offset_of


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _set_path(root: dict[str, Any], path: Path, value: Any, fqn: str) -> None:
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        node = _child(node, key, [] if isinstance(nxt, int) else {}, fqn)
    _child(node, path[-1], value, fqn, leaf=True)


def _child(node: Any, key: str | int, new: Any, fqn: str, leaf: bool = False) -> Any:
    if isinstance(node, list) and isinstance(key, int):
        node.extend([None] * (key + 1 - len(node)))
        if leaf or node[key] is None:
            node[key] = new
        return node[key]
    if isinstance(node, dict) and isinstance(key, str):
        if leaf:
            node[key] = new
        return node.setdefault(key, new)
    raise CheckpointFormatError(f"DCP key {fqn!r}: its nesting (planner_data) is inconsistent")


def _int_optimizer_keys(node: Any) -> None:
    """DCP stringifies dict keys; an optimizer's ``state`` is keyed by int param ids,
    which ``Optimizer.load_state_dict`` matches against ``param_groups[*]["params"]``
    (string keys would be kept but never matched: silently lost state). DCP also drops
    empty dicts, so an un-stepped optimizer comes back without its (empty) ``state``."""
    for value in _dicts(node):
        state, groups = value.get("state"), value.get("param_groups")
        if state is None and isinstance(groups, list) and "state" not in value:
            value["state"] = state = {}  # DCP drops empty dicts: an un-stepped optimizer's
        if not (isinstance(state, dict) and isinstance(groups, list)):
            continue
        ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
        if ids and all(isinstance(i, int) for i in ids) and all(k.isdigit() for k in state):
            value["state"] = {int(k): v for k, v in state.items()}


def _dicts(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _dicts(v)
    elif isinstance(node, list):
        for v in node:
            yield from _dicts(v)


def write(storage: Storage, step: int, loaded: Loaded, meta: dict[str, Any]) -> tuple[int, int]:
    """Write ``loaded`` as rank 0 of a one-rank checkpoint and commit it; returns
    (tensors, tensor bytes)."""
    tree, leaves = flatten(loaded.root)
    data, offset_of = loaded.buf, loaded.offset_of
    if not all(id(leaf.tensor) in offset_of for leaf in leaves):
        # arrays that came out of a non-tensor value (numpy RNG state): pack afresh
        offset_of, pos = {}, 0
        for leaf in leaves:
            offset_of[id(leaf.tensor)] = pos
            pos += _aligned(leaf.tensor.nbytes)
        data = torch.empty(pos, dtype=torch.uint8)
        for leaf in leaves:
            off, t = offset_of[id(leaf.tensor)], leaf.tensor.detach()
            data[off : off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    layout = [
        {
            "id": i,
            "path": leaf.path,
            "dtype": str(leaf.tensor.dtype).removeprefix("torch."),
            "shape": list(leaf.tensor.shape),
            "nbytes": leaf.tensor.nbytes,
            "offset": offset_of[id(leaf.tensor)],
            "shard": None,
        }
        for i, leaf in enumerate(leaves)
    ]
    write_rank(
        storage,
        step=step,
        rank=0,
        world_size=1,
        tree=tree,
        layout=layout,
        data=byte_view(data),
        known={},
    )
    publish_step(storage, step, 1, meta=meta)
    return len(leaves), sum(leaf.tensor.nbytes for leaf in leaves)


def remove_written(storage: Storage, step: int) -> None:
    """Best effort after a failed import into what was an empty directory."""
    for name in storage.listdir("data"):
        storage.delete(f"data/{name}")
    for name in storage.listdir(step_dir(step)):
        storage.delete(f"{step_dir(step)}/{name}")
    storage.delete_dir("data")
    storage.delete_dir(step_dir(step))
