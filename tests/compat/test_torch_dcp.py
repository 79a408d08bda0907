"""stalwart.compat.torch_dcp against the installed torch: the private names a DCP
metadata pickle refers to, and a DTensor shard's offset."""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.compat import torch_c10d, torch_dcp

from ._seam import changed, relied_on

V = f"torch {torch.__version__}"


def test_the_metadata_pickles_private_names_are_there() -> None:
    for module, names in torch_dcp.METADATA_PRIVATE_GLOBALS.items():
        for name in names:
            relied_on(
                importlib.import_module(module),
                name,
                version=V,
                label=module,
                by="torch_dcp.METADATA_PRIVATE_GLOBALS",
            )


def test_a_saved_metadata_names_no_other_private_global(tmp_path: Any) -> None:
    """Everything a real DCP ``.metadata`` pickle names with a leading underscore is in
    the list (a new private class there would make the DCP import refuse the file)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2, 2), "n": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    names = {
        (m, n)
        for m, n in _globals((tmp_path / ".metadata").read_bytes())
        if n.startswith("_") or any(p.startswith("_") for p in m.split("."))
    }
    listed = {(m, n) for m, ns in torch_dcp.METADATA_PRIVATE_GLOBALS.items() for n in ns}
    assert names <= listed, changed(
        "DCP's .metadata pickle",
        V,
        "torch_dcp.METADATA_PRIVATE_GLOBALS",
        f"names {sorted(names - listed)} too",
    )


def _globals(data: bytes) -> list[tuple[str, str]]:
    """The (module, name) pairs the pickle resolves, in order."""
    seen: list[tuple[str, str]] = []

    class _Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.append((module, name))
            return super().find_class(module, name)

    _Recording(io.BytesIO(data)).load()
    return seen


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("gloo", store=torch_c10d.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_shard_offset(world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, _utils, distribute_tensor

    relied_on(
        _utils,
        "compute_local_shape_and_global_offset",
        version=V,
        by="torch_dcp.shard_offsets",
        params=["global_shape", "mesh", "placements"],
    )
    mesh = init_device_mesh("cpu", (1,))
    t = distribute_tensor(torch.arange(6.0).view(3, 2), mesh, [Shard(0)])
    assert list(torch_dcp.shard_offsets(t)) == [0, 0]
