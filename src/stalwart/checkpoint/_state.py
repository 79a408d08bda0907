"""Capture a tracked training state as (tree, leaves) and put a loaded one back.

A tracked state is a mapping ``name -> object``; an object with ``state_dict()`` /
``load_state_dict()`` (model, optimizer, scheduler, data loader, :class:`RNGState`, ...)
is captured through them, anything else (tensors, dicts of tensors, numbers) as is.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stalwart.checkpoint._lazy import loading, looking
from stalwart.checkpoint._tree import Leaf, flatten
from stalwart.compat.torch_dcp import shard_offsets
from stalwart.errors import StateMismatchError
from stalwart.logs import get_logger

__all__ = [
    "RNGState",
    "apply_state",
    "capture",
    "deferrable_ptrs",
    "fresh_optimizer_targets",
    "local_and_shard",
]

_log = get_logger(__name__)


class RNGState:
    """The process's random number generators (torch CPU and CUDA, Python, numpy) as a
    stateful object, so that a restored run draws the same random numbers."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            sd["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            sd["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        version, internal, gauss = sd["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])
        if "numpy" in sd:
            import numpy as np

            kind, keys, pos, has_gauss, cached = sd["numpy"]
            np.random.set_state((kind, np.asarray(keys), pos, has_gauss, cached))


def _is_stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def capture(state: Mapping[str, Any], *, for_restore: bool = False) -> tuple[Any, list[Leaf]]:
    """Flatten every tracked object's current state, creating none (checkpoint/_lazy.py:
    a snapshot taken before the first step must not initialise an optimizer's state).

    ``for_restore``: the tensors a restore is about to load into. There an optimizer's
    state may be created as its ``state_dict()`` creates it (DCP's lazy initialisation):
    the restore replaces that state (or empties it again, for a snapshot without one,
    checkpoint/_lazy.py ``loading``), and a fresh optimizer of DTensor parameters (FSDP2
    behind a container) gets moments of its parameters' mesh to load its shards into."""
    if for_restore:
        raw = {name: obj.state_dict() if _is_stateful(obj) else obj for name, obj in state.items()}
        return flatten(raw)
    with looking(", ".join(map(str, state))):
        raw = {name: obj.state_dict() if _is_stateful(obj) else obj for name, obj in state.items()}
    return flatten(raw)


def local_and_shard(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[int]] | None]:
    """The local bytes of ``t`` and, for a DTensor, where they sit in the global tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.4
        return t, None
    if not isinstance(t, DTensor):
        return t, None
    offsets = shard_offsets(t)
    return t.to_local(), {"global_shape": list(t.shape), "offsets": [int(o) for o in offsets]}


def fresh_optimizer_targets(
    state: Mapping[str, Any], saved: Iterable[tuple[str, list[int], str]]
) -> dict[str, torch.Tensor]:
    """Empty DTensors, one per saved moment of a DTensor parameter (FSDP2) that a
    tracked optimizer has no state for yet, keyed by the saved ``(path, global shape,
    dtype)``'s path.

    Why: a fresh optimizer (a restarted worker's, or one restored at another world size)
    holds no ``exp_avg`` to load into, so without a target the saved tensor would come
    back as it was written: another world size's shard, or a whole tensor (a DCP
    import), never this rank's shard. With a target of the parameter's mesh and
    placements the restore cuts this rank's box out of the saved pieces, as it does
    for the parameters. A moment is matched to its parameter by position (the ids
    ``Optimizer.state_dict`` assigns) and by global shape."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.4
        return {}
    wanted: dict[str, Any] = {}
    for name, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        params = [p for g in obj.param_groups for p in g["params"]]
        for pid, p in enumerate(params):
            if isinstance(p, DTensor) and not obj.state.get(p):
                wanted[f".{name}.state.{pid}."] = p
    out: dict[str, torch.Tensor] = {}
    for path, global_shape, dtype in saved:
        head, _, key = path.rpartition(".")
        p = wanted.get(head + ".")
        if p is None or not key or list(p.shape) != list(global_shape) or p.dim() == 0:
            continue
        local = torch.empty(p.to_local().shape, dtype=getattr(torch, dtype))
        out[path] = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return out


def deferrable_ptrs(state: Mapping[str, Any]) -> set[int]:
    """Storage addresses of tensors that change only at an optimizer step: parameters of
    tracked modules and the state of tracked optimizers. A snapshot may copy those while
    the next forward/backward runs; everything else (buffers such as BatchNorm's running
    stats change during forward) is copied before the snapshot call returns."""
    ptrs: set[int] = set()
    for obj in state.values():
        if isinstance(obj, torch.nn.Module):
            ptrs.update(p.data_ptr() for p in obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs


def apply_state(state: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Load ``loaded`` (decoded checkpoint tree) into the tracked objects.

    A tracked :class:`RNGState` the checkpoint lacks is the one gap that is not an
    error: ``stalwart run`` tracks the RNGs itself (``_rng``), and a checkpoint written
    elsewhere (``stalwart ckpt import``) cannot hold them, so resuming from it would
    otherwise always fail on a name the script never tracked."""
    unseeded = [k for k in state if k not in loaded and isinstance(state[k], RNGState)]
    missing = [k for k in state if k not in loaded and k not in unseeded]
    extra = [k for k in loaded if k not in state]
    if missing or extra:
        raise StateMismatchError(
            "tracked state does not match the checkpoint: "
            + (f"missing in checkpoint: {', '.join(map(str, missing))}; " if missing else "")
            + (f"not tracked now: {', '.join(map(str, extra))}; " if extra else "")
            + "track the same names as when the checkpoint was written"
        )
    if unseeded:
        _log.warning(
            "the checkpoint holds no RNG state (%s): the random number generators go on "
            "from this process's own seeding (a checkpoint written outside stalwart, such "
            "as a DCP import, has none; the run is not bit-reproducible against the original)",
            ", ".join(unseeded),
        )
    for name, obj in state.items():
        if name in unseeded:
            continue
        value = loaded[name]
        if isinstance(obj, torch.nn.Module):
            value = _with_ddp_prefix(obj, value)
            _check_module_keys(name, obj, value)
            if _loaded_in_place(obj, value):
                continue
        if isinstance(obj, torch.optim.Optimizer):
            value = _optimizer_state_as_dtensors(obj, value)
        if _is_stateful(obj):
            try:
                with loading(value):  # a state without optimizer state restores none
                    obj.load_state_dict(value)
            except (RuntimeError, KeyError, ValueError) as err:
                first = str(err).strip().splitlines()[0][:300]
                raise StateMismatchError(
                    f"cannot load {name!r} from the checkpoint: {first}; "
                    "check that the model/optimizer is built as when the checkpoint was saved"
                ) from err
        elif isinstance(obj, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != obj.shape:
                raise StateMismatchError(
                    f"{name!r}: checkpoint holds {_describe(value)}, tracked tensor has shape "
                    f"{tuple(obj.shape)}; track a tensor of the saved shape"
                )
            if value.data_ptr() != obj.data_ptr():
                obj.copy_(value)
        elif isinstance(obj, dict):
            obj.clear()
            obj.update(value)


def _optimizer_state_as_dtensors(opt: torch.optim.Optimizer, value: Any) -> Any:
    """A fresh optimizer (a replacement worker's) gets its state as plain tensors of the
    local shard's shape; for a DTensor parameter (FSDP2) wrap each one as a DTensor with
    the parameter's mesh and placements, or the next step mixes Tensor and DTensor."""
    if not isinstance(value, dict) or not value.get("state"):
        return value
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.4
        return value
    saved_ids = [i for g in value.get("param_groups", []) for i in g.get("params", [])]
    params = [p for g in opt.param_groups for p in g["params"]]
    by_id = dict(zip(saved_ids, params, strict=False))
    state = {}
    for pid, st in value["state"].items():
        p = by_id.get(pid)
        if isinstance(p, DTensor) and isinstance(st, dict):
            local_shape = p.to_local().shape
            st = {
                k: DTensor.from_local(
                    v,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
                if isinstance(v, torch.Tensor)
                and not isinstance(v, DTensor)
                and v.shape == local_shape
                and v.dim() > 0
                else v
                for k, v in st.items()
            }
        state[pid] = st
    return {**value, "state": state}


def _loaded_in_place(module: torch.nn.Module, value: dict[str, Any]) -> bool:
    """True when every loaded tensor already is the module's own parameter or buffer
    memory (restore reads straight into it): ``load_state_dict`` would then copy each
    tensor onto itself, a full memcpy of the model for nothing."""
    own = module.state_dict(keep_vars=True)
    return all(
        isinstance(v, torch.Tensor)
        and v.data_ptr() == own[k].data_ptr()
        and v.shape == own[k].shape
        and v.dtype == own[k].dtype
        for k, v in value.items()
    )


_DDP_PREFIX = "module."


def _with_ddp_prefix(module: torch.nn.Module, value: Any) -> Any:
    """``value`` with DDP's ``module.`` prefix added when ``module`` is tracked as its
    DDP wrapper and ``value`` is the plain model's state dict (a DCP export strips the
    prefix so that the plain model loads it, and a DCP checkpoint of a plain model has
    none): exactly the wrapper's keys after prefixing, else ``value`` unchanged."""
    if not isinstance(value, dict) or not value:
        return value
    want = set(module.state_dict().keys())
    if want == set(value) or not all(isinstance(k, str) for k in value):
        return value
    prefixed = {_DDP_PREFIX + k: v for k, v in value.items()}
    return prefixed if set(prefixed) == want else value


def _check_module_keys(name: str, module: torch.nn.Module, value: Any) -> None:
    want = set(module.state_dict().keys())
    have = set(value.keys()) if isinstance(value, dict) else set()
    if want != have:
        missing = sorted(want - have)[:8]
        extra = sorted(have - want)[:8]
        raise StateMismatchError(
            f"{name!r}: model keys differ from the checkpoint "
            + (f"(missing: {', '.join(missing)}) " if missing else "")
            + (f"(unexpected: {', '.join(extra)}) " if extra else "")
            + "; build the same model architecture as the one that was saved"
        )


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"
