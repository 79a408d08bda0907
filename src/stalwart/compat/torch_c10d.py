"""torch.distributed's c10d internals stalwart relies on, in one place.

stalwart swaps the process group under a live job (runtime/comm/_world.py: the job's default
group; runtime/comm/_fsdp.py and runtime/comm/_mesh.py: the group under an FSDP2 mesh) and keeps
the groups a script destroys alive (agent/processes/_teardown.py). torch has no public API for any
of that: c10d's registry of groups (``distributed_c10d._world``) and the default group
can only be changed through ``init_process_group``/``new_group``, which make a new
backend, and a Python ``ProcessGroup`` answers some collectives under private names.
Each function below names what it relies on; tests/compat/test_torch_c10d.py fails,
naming the function, when an upgrade of torch changes it. Tested with torch 2.13.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch._C._distributed_c10d as _C
from torch.distributed import distributed_c10d as _c10d

__all__ = [
    "AllgatherOptions",
    "GradBucket",
    "HashStore",
    "PrefixStore",
    "TCPStore",
    "allgather_base",
    "forget_group",
    "python_process_group",
    "reduce_scatter_base",
    "register_group",
    "registered_groups",
    "set_default_group",
    "set_group_ranks",
    "work_from_future",
]

# the options of an all-gather into one tensor: torch.distributed exports the other
# collectives' options, not this one
AllgatherOptions = _C.AllgatherOptions
# public at run time (torch.distributed.TCPStore, ...), but torch.distributed imports them
# from its C extension without re-exporting them to a type checker: taken from there
GradBucket = _C.GradBucket
HashStore = _C.HashStore
PrefixStore = _C.PrefixStore
TCPStore = _C.TCPStore

_T = TypeVar("_T", bound=type)


def work_from_future(fut: torch.futures.Future[Any]) -> Any:
    """A completed c10d ``Work`` of ``fut`` (``torch._C._distributed_c10d.
    _create_work_from_future``): what a Python ``ProcessGroup``'s collective must return;
    torch documents it as the way to write one, but only under this private name."""
    return _C._create_work_from_future(fut)  # type: ignore[attr-defined]


def register_group(pg: Any, store: Any, ranks: dict[int, int], backend: str) -> None:
    """Enter ``pg`` in c10d's registry (``_world.pg_map``, ``pg_names``,
    ``pg_group_ranks``, ``pg_to_tag``, ``tags_to_pg``) and C++'s name table
    (``_register_process_group``) as ``new_group`` would: ``DeviceMesh.from_group``,
    ``get_rank(group)`` and functional collectives accept only a registered group, and
    ``new_group`` cannot register a group made in Python. ``ranks`` maps global ranks to
    group ranks, in group-rank order."""
    w = _c10d._world
    w.pg_map[pg] = (backend, store)
    w.pg_names[pg] = pg.group_name
    w.pg_group_ranks[pg] = dict(ranks)
    w.pg_to_tag[pg] = f"ptd:{pg.group_name}"
    w.tags_to_pg.setdefault(f"ptd:{pg.group_name}", []).append(pg)
    _C._register_process_group(pg.group_name, pg)


def forget_group(pg: Any) -> None:
    """Undo :func:`register_group` (``_unregister_process_group`` and the registry's
    tables) without destroying ``pg``: ``destroy_process_group`` would also shut the
    backend down, and the job's groups are replaced while their backend lives on."""
    w = _c10d._world
    name = w.pg_names.get(pg)
    if name is not None:
        _C._unregister_process_group(name)
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_to_tag):
        table.pop(pg, None)
    for pgs in w.tags_to_pg.values():
        if pg in pgs:
            pgs.remove(pg)


def set_default_group(pg: Any) -> None:
    """Make ``pg`` c10d's default group (``distributed_c10d._update_default_pg``): what
    ``dist.all_reduce(x)`` and ``dist.get_rank()`` use; only ``init_process_group`` sets
    it publicly, and it makes a new backend."""
    _c10d._update_default_pg(pg)


def set_group_ranks(pg: Any, ranks: dict[int, int]) -> None:
    """Set the global-to-group rank map c10d keeps for ``pg`` (``_world.pg_group_ranks``):
    the job's rank changes under a group made once (the local world-size-1 group)."""
    _c10d._world.pg_group_ranks[pg] = ranks


def registered_groups() -> list[Any]:
    """Every group c10d holds now (``_world.pg_map``'s keys): what
    ``destroy_process_group()`` is about to destroy."""
    return list(_c10d._world.pg_map)


def allgather_base(pg: Any, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
    """``pg``'s all-gather into one tensor (``ProcessGroup._allgather_base``): a backend
    (``ProcessGroupGloo``) has it only under this name; ``dist.all_gather_single`` takes
    a registered group, not a backend object."""
    return pg._allgather_base(out, inp, opts)


def reduce_scatter_base(pg: Any, out: torch.Tensor, inp: torch.Tensor, opts: Any) -> Any:
    """``pg``'s reduce-scatter of one tensor (``ProcessGroup._reduce_scatter_base``), the
    same way (``dist.reduce_scatter_single`` takes a registered group)."""
    return pg._reduce_scatter_base(out, inp, opts)


# a Python ProcessGroup's public method -> the private name c10d may call it by: the
# C++ ProcessGroup interface's names of the one-tensor collectives (torch 2.13's Python
# API calls the public ones; :func:`allgather_base` on a stand-in calls these), and the
# property the object collectives read the group's device from
_HOOKS = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "device_types": "_device_types",
}


def python_process_group(cls: _T) -> _T:
    """Class decorator: a Python ``ProcessGroup`` (or a stand-in passed where one is
    expected) answers c10d's private hooks through its public methods,
    ``all_gather_single`` as ``_allgather_base``, ``reduce_scatter_single`` as
    ``_reduce_scatter_base`` and the property ``device_types`` as ``_device_types``
    (those the class itself defines; a subclass that redefines one is decorated too)."""
    for public, private in _HOOKS.items():
        if public in vars(cls):
            setattr(cls, private, vars(cls)[public])
    return cls
