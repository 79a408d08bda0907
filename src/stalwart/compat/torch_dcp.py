"""torch.distributed.checkpoint's and DTensor's internals stalwart's checkpoint relies on.

tests/compat/test_torch_dcp.py fails, naming the use, when torch changes one. Tested with
torch 2.13.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["METADATA_PRIVATE_GLOBALS", "shard_offsets"]

# The private names a DCP ``.metadata`` pickle refers to, beside its public classes: the
# DCP import's restricted unpickler (checkpoint/_dcp_import.py) resolves only what it
# lists, and DCP pickles these (a tensor's memory format table, a storage entry's
# location, torch's map of a layout's name to ``torch.strided``) with no public
# equivalent to name instead.
METADATA_PRIVATE_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
}


def shard_offsets(t: Any) -> Sequence[int]:
    """Where DTensor ``t``'s local shard starts in the global tensor, per dimension
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``): DTensor
    exposes the local tensor, not its offset (uneven shards make it more than
    rank * size)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape: torch.Size = t.shape
    _, offsets = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
    return offsets
