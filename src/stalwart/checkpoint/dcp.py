"""Interop with ``torch.distributed.checkpoint`` (DCP): export to it, import from it.

Why: a checkpoint format nobody else reads is lock-in. :func:`export_dcp` writes a
directory that plain ``torch.distributed.checkpoint.load`` reads with only torch
installed; :func:`import_dcp` turns a DCP checkpoint (torchtitan's, or any
``dcp.save`` output) into a committed stalwart checkpoint to start a run from.

Export reads every chunk through the engine's verified reader (a checksum per chunk),
assembles DTensor shards saved by several ranks into full tensors, and hands the
nested ``{name: state_dict}`` to ``dcp.save`` in a sibling temp directory that is
renamed into place, so a failed export leaves no half-written output.

Import never runs ``pickle`` on untrusted bytes: DCP's ``.metadata`` file is a pickle,
so it is read by an unpickler that resolves only DCP's own metadata classes, and every
non-tensor value is loaded with ``torch.load(weights_only=True)``; what that refuses
(e.g. torchtitan's ``io.BytesIO`` loss history) is skipped and named in the report.
See docs/interop.md for the loading recipes.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
import warnings
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stalwart.checkpoint import _dcp_import as _imp
from stalwart.checkpoint._layout import layout_problems
from stalwart.checkpoint._load import allocate
from stalwart.checkpoint._tree import unflatten
from stalwart.checkpoint.catalog import load_index, load_manifest, require_checkpoint_root
from stalwart.checkpoint.format import TensorEntry, parse_step_dir
from stalwart.checkpoint.restore import read_into, read_tensor
from stalwart.checkpoint.storage import Storage, open_storage
from stalwart.checkpoint.storage.local import fsync_dir
from stalwart.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    UnsupportedStateError,
)

__all__ = ["ExportReport", "ImportReport", "export_dcp", "import_dcp"]


@dataclass
class ExportReport:
    src: str
    out: str
    step: int
    world_size: int
    tensors: int = 0  # tensor entries in the DCP output
    tensor_bytes: int = 0
    other_values: int = 0  # non-tensor entries (DCP stores them as bytes)
    assembled: int = 0  # tensors assembled from DTensor shards of several ranks
    chunks_verified: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # newer steps that failed to verify
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        extra = f", {self.assembled} assembled from shards" if self.assembled else ""
        fallback = ""
        if self.skipped:
            fallback = f"; passed over {len(self.skipped)} problem(s) in newer steps"
        return (
            f"exported step {self.step} of {self.src} to {self.out} (DCP): {self.tensors} "
            f"tensors ({_mb(self.tensor_bytes)}){extra}, {self.other_values} other values, "
            f"{self.chunks_verified} chunks verified in {self.seconds:.2f} s{fallback}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ImportReport:
    src: str
    out: str
    step: int
    names: list[str] = field(default_factory=list)  # tracked-state names, e.g. model
    tensors: int = 0
    tensor_bytes: int = 0
    other_values: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # "fqn: why" for values not imported
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        skipped = f"; skipped {len(self.skipped)}: {self.skipped[0]}" if self.skipped else ""
        more = " ..." if len(self.skipped) > 1 else ""
        return (
            f"imported DCP {self.src} into {self.out} as step {self.step}: "
            f"{', '.join(self.names) or 'nothing'}; {self.tensors} tensors "
            f"({_mb(self.tensor_bytes)}), {self.other_values} other values in "
            f"{self.seconds:.2f} s{skipped}{more}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# --------------------------------------------------------------------------- export
def export_dcp(src: str, out: str, *, step: int | None = None) -> ExportReport:
    """Write the newest valid (or exactly ``step``) committed checkpoint at ``src`` as a
    DCP checkpoint in the new local directory ``out``."""
    t0 = time.perf_counter()
    if step is not None and step < 0:
        raise ConfigError(f"--step {step}: a step is a non-negative integer")
    storage = open_storage(src)
    try:
        steps = require_checkpoint_root(storage)
    except CheckpointNotFoundError as err:
        if storage.exists(_imp.METADATA_FILE):
            raise CheckpointFormatError(
                f"{src}: this is a DCP checkpoint, not a stalwart one; "
                "load it with torch directly or convert it with `stalwart ckpt import`"
            ) from err
        if storage.kind("ckpt") == "dir":
            raise CheckpointNotFoundError(
                f"{src}: a run directory, not a checkpoint; its checkpoints are in "
                f"{src.rstrip('/')}/ckpt: pass that"
            ) from err
        raise
    if step is not None and step not in steps:
        raise CheckpointNotFoundError(
            f"{src}: no committed step {step} (committed: {_fmt_steps(steps)}); "
            "pass one of those or omit --step for the newest"
        )
    _require_new_local_dir(out, "export")
    skipped: list[str] = []
    for s in [step] if step is not None else reversed(steps):
        try:
            state, report = _read_step(storage, s)
        except (CheckpointCorruptError, CheckpointFormatError) as err:
            if step is not None:
                raise
            problems = err.problems if isinstance(err, CheckpointCorruptError) else []
            skipped.extend(f"step {s}: {p}" for p in (problems or [str(err)]))
            continue
        break
    else:
        raise CheckpointCorruptError(
            f"no checkpoint in {src} verifies: " + "; ".join(skipped[:3]), skipped
        )
    metadata = _save_dcp(state, out)
    report.src, report.out, report.skipped = src, out, skipped
    for md in metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            report.tensors += 1
            report.tensor_bytes += md.size.numel() * md.properties.dtype.itemsize
        else:
            report.other_values += 1
    report.seconds = time.perf_counter() - t0
    return report


def _fmt_steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[-8:])) + (" ..." if len(steps) > 8 else "")


def _read_step(storage: Storage, step: int) -> tuple[dict[str, Any], ExportReport]:
    """The decoded state of ``step``: every chunk is checksummed as it is read, and
    DTensor shards are assembled across ranks. Nothing is written before all of it
    verified, so a corrupt step costs no output."""
    manifest = load_manifest(storage, step)
    report = ExportReport("", "", step, manifest.world_size)
    primary = load_index(storage, manifest, 0)
    sharded = any(t.shard for t in primary.tensors)
    pieces: dict[str, list[TensorEntry]] = {}
    if sharded:
        indexes = [primary] + [
            load_index(storage, manifest, r) for r in range(1, manifest.world_size)
        ]
        problems = layout_problems(indexes)  # before anything is allocated or written
        if problems:
            raise CheckpointFormatError(problems[0])
        for index in indexes:
            for t in index.tensors:
                if t.copy_of is None:  # an HSDP replica's copy names its bytes' rank
                    pieces.setdefault(t.path, []).append(t)
    if manifest.world_size > 1 and not manifest.replicated:
        what = "DTensor shards assembled; other values" if sharded else "no DTensor shards:"
        report.notes.append(
            f"{manifest.world_size} ranks, {what} rank 0's were exported "
            "(per-rank values of other ranks, e.g. RNG states, are not in the output)"
        )
    tensors: dict[int, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for t in primary.tensors:
            if t.shard:
                parts = _unique_boxes(pieces[t.path])
                tensors[t.id] = _assemble(storage, t, parts, pool)
                report.chunks_verified += sum(len(p.chunks) for p in parts)
                report.assembled += int(len(parts) > 1)
            else:
                tensors[t.id] = read_tensor(storage, t, pool)
                report.chunks_verified += len(t.chunks)

    def tensor_of(i: int, is_ndarray: bool) -> Any:
        return tensors[i].numpy() if is_ndarray else tensors[i]

    try:
        state = unflatten(primary.tree, tensor_of)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointFormatError(f"step {step}: malformed state tree in rank 0 ({err})") from err
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointFormatError(f"step {step}: the saved state is not a mapping of names")
    for name, value in state.items():
        stripped = _strip_ddp_prefix(value)
        if stripped is not value:
            state[name] = stripped
            report.notes.append(f"{name}: DDP's 'module.' prefix removed from its keys")
    return state, report


_DDP_PREFIX = "module."


def _strip_ddp_prefix(value: Any) -> Any:
    """A DDP model's state dict without DDP's ``module.`` prefix (``value`` itself when
    it is not one: every key must be a string with the prefix), so that the export loads
    into the plain model, as docs/interop.md shows. An optimizer's state dict (int
    parameter ids) never matches."""
    if not isinstance(value, dict) or not value:
        return value
    if not all(isinstance(k, str) and k.startswith(_DDP_PREFIX) for k in value):
        return value
    out = {k[len(_DDP_PREFIX) :]: v for k, v in value.items()}
    return out if len(out) == len(value) else value


def _unique_boxes(parts: list[TensorEntry]) -> list[TensorEntry]:
    """One piece per shard box: ranks that replicate a shard (HSDP) saved the same box."""
    seen: dict[tuple[int, ...], TensorEntry] = {}
    for p in parts:
        seen.setdefault(tuple((p.shard or {}).get("offsets", [0] * len(p.shape))), p)
    return list(seen.values())


def _assemble(
    storage: Storage, entry: TensorEntry, parts: list[TensorEntry], pool: ThreadPoolExecutor
) -> torch.Tensor:
    assert entry.shard is not None
    shape = [int(x) for x in entry.shard["global_shape"]]
    full = allocate(shape, getattr(torch, entry.dtype), entry.path)
    covered = 0
    for p in parts:
        offs = [int(x) for x in (p.shard or {}).get("offsets", [0] * len(shape))]
        if len(offs) != len(shape) or any(
            o < 0 or o + n > g for o, n, g in zip(offs, p.shape, shape, strict=True)
        ):
            raise CheckpointFormatError(
                f"tensor {entry.path!r}: shard at offsets {offs} with shape {p.shape} lies "
                f"outside the global shape {shape}; the index is damaged"
            )
        box = tuple(slice(o, o + n) for o, n in zip(offs, p.shape, strict=True))
        dst = full[box]
        if dst.is_contiguous():  # a row block (FSDP2's Shard(0)): read straight into it
            read_into(storage, p, dst, pool)
        else:
            dst.copy_(read_tensor(storage, p, pool))
        covered += p.nbytes
    if covered != full.numel() * full.element_size():
        raise CheckpointCorruptError(
            f"tensor {entry.path!r}: the saved shards cover {covered} of "
            f"{full.numel() * full.element_size()} bytes; the checkpoint is missing ranks",
            [f"{entry.path}: shards cover {covered} of {full.nbytes} bytes (missing ranks)"],
        )
    return full


def _require_new_local_dir(out: str, what: str) -> None:
    if "://" in out and not out.startswith("file://"):
        raise ConfigError(f"{out}: DCP {what} works on local directories; pass a local path")
    path = out.removeprefix("file://")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(
            f"{out}: already exists and is not an empty directory; "
            f"{what} into a new or empty directory"
        )


def _save_dcp(state: dict[str, Any], out: str) -> Metadata:
    """``dcp.save`` without a process group into a temp sibling, renamed into place."""
    out = os.path.abspath(out.removeprefix("file://"))
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.{uuid.uuid4().hex[:8]}.tmp")
    os.mkdir(tmp)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                metadata: Metadata = dcp_save(
                    state, storage_writer=FileSystemWriter(tmp), no_dist=True
                )
            except ValueError as err:  # e.g. two paths that flatten to the same DCP key
                raise UnsupportedStateError(f"cannot express the state in DCP: {err}") from err
        if os.path.isdir(out):
            os.rmdir(out)  # checked empty before
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    return metadata


# --------------------------------------------------------------------------- import
def import_dcp(
    src: str,
    out: str,
    *,
    step: int = 0,
    include: Collection[str] | None = None,
    flat_into: str = "model",
) -> ImportReport:
    """Write the DCP checkpoint in ``src`` as committed step ``step`` of a new stalwart
    checkpoint at ``out``. Top-level names of the DCP state dict become tracked-state
    names; ``include`` keeps only some of them. Top-level tensors (torchtitan saves model
    weights flat) are grouped under ``flat_into`` unless that name is taken."""
    t0 = time.perf_counter()
    if step < 0:
        raise ConfigError(f"--step {step}: a step is a non-negative integer")
    if "://" in src and not src.startswith("file://"):
        raise ConfigError(f"{src}: DCP import reads a local directory; pass a local path")
    src = src.removeprefix("file://")
    if not os.path.isdir(src):
        raise CheckpointNotFoundError(
            f"{src}: no such directory; pass the directory torch.distributed.checkpoint wrote"
        )
    if not os.path.isfile(os.path.join(src, _imp.METADATA_FILE)):
        hint = ""
        if any(parse_step_dir(n) is not None for n in os.listdir(src)):
            hint = " (it looks like a stalwart checkpoint: restore from it directly)"
        raise CheckpointFormatError(
            f"{src}: not a DCP checkpoint, no {_imp.METADATA_FILE} file{hint}; "
            "pass the directory torch.distributed.checkpoint.save wrote"
        )
    metadata = _imp.read_metadata(src)
    storage = open_storage(out)
    if storage.listdir(""):
        raise ConfigError(f"{out}: not empty; import into a new or empty directory")
    loaded = _imp.load_nested(src, metadata, include, flat_into)
    meta = {"imported_from": os.path.abspath(src), "source_format": "torch.distributed.checkpoint"}
    try:
        tensors, nbytes = _imp.write(storage, step, loaded, meta)
    except BaseException:
        _imp.remove_written(storage, step)
        raise
    return ImportReport(
        src,
        out,
        step,
        names=sorted(loaded.root),
        tensors=tensors,
        tensor_bytes=nbytes,
        other_values=loaded.other_values,
        seconds=time.perf_counter() - t0,
        skipped=loaded.skipped,
        notes=loaded.notes,
    )
