"""The outer step of ``--strategy async``: what a synchronisation does to the parameters.

Replica groups train independently for H steps, then each contributes its parameters;
the outer step turns the contributions of the groups that made it into the next global
parameters. DiLoCo (Douillard et al., 2023) treats ``start - mean(contributions)`` as a
pseudo-gradient and applies Nesterov SGD to it (``--outer-lr``, ``--outer-momentum``);
LocalSGD is the special case lr = 1, momentum = 0, where the result is exactly the
mean (computed as such, so that it is the average to the last bit).

Why every group computes it itself instead of one group broadcasting it: the result is
a deterministic function of the agreed roster's contributions (summed in roster order),
the round's start and the momentum buffer, which every group holds alike; no group then
waits for another to send it, and the death of any one does not stall the others.

The wire format of a parameter set (contributions and the published global state) is
:func:`encode`/:func:`decode`: a 4-byte big-endian header length, a JSON header
(``{"v": 1, "tensors": [[name, dtype, shape, nbytes], ...]}``) and the raw little-endian
tensor bytes in header order; no pickle (docs/async.md).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from stalwart.errors import StalwartError

__all__ = ["OuterConfig", "OuterOptimizer", "ParamSetError", "decode", "encode"]

FORMAT_VERSION = 1
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_MAX_HEADER = 16 << 20

Params = dict[str, torch.Tensor]


class ParamSetError(StalwartError):
    """A parameter set read from the store is malformed or does not match the model."""


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer of a synchronisation."""

    lr: float = 0.7
    """Outer learning rate: how far the global parameters move along the averaged
    pseudo-gradient (DiLoCo's 0.7; 1.0 with momentum 0 is LocalSGD's plain average)."""
    momentum: float = 0.9
    """Nesterov momentum of the outer step (DiLoCo's 0.9): a drift common to every
    group's H steps keeps its direction across rounds."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ParamSetError(f"--outer-lr {self.lr}: use a finite rate > 0 (1.0: LocalSGD)")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ParamSetError(f"--outer-momentum {self.momentum}: use 0 <= momentum < 1")

    @property
    def averages(self) -> bool:
        """LocalSGD: the next parameters are the contributions' mean, nothing else."""
        return self.lr == 1.0 and self.momentum == 0.0


class OuterOptimizer:
    """The outer state (the round's start parameters and the momentum buffer) and its
    step. The owner of that state: a rejoining group receives it whole
    (:meth:`state_dict` / :meth:`load_state_dict`)."""

    def __init__(self, config: OuterConfig) -> None:
        self.config = config
        self.round = 0
        self.start: Params = {}
        self.momentum: Params = {}

    def begin(self, params: Mapping[str, torch.Tensor], round_: int = 0) -> None:
        """The global parameters at ``round_`` (a fresh start: the script's own)."""
        self.round = round_
        self.start = {k: v.detach().clone() for k, v in params.items()}
        # zeros, not absent: the first step's buffer is the pseudo-gradient all the same
        # (0 * m + g), and the snapshot's layout does not change after the first round
        self.momentum = (
            {} if self.config.averages else {k: torch.zeros_like(v) for k, v in self.start.items()}
        )

    def step(self, contributions: Sequence[Mapping[str, torch.Tensor]]) -> Params:
        """The next global parameters from ``contributions`` (in roster order)."""
        if not contributions:
            raise ParamSetError("an outer step needs at least one contribution")
        for c in contributions:
            _check_like(self.start, c)
        n = len(contributions)
        out: Params = {}
        for name, start in self.start.items():
            total = contributions[0][name].to(torch.float64).clone()
            for c in contributions[1:]:
                total += c[name].to(torch.float64)
            mean = (total / n).to(start.dtype)
            out[name] = mean if self.config.averages else self._nesterov(name, start, mean)
        self.start = {k: v.clone() for k, v in out.items()}
        self.round += 1
        return out

    def _nesterov(self, name: str, start: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """torch.optim.SGD(nesterov=True) on the pseudo-gradient ``start - mean``."""
        lr, m = self.config.lr, self.config.momentum
        grad = start - mean
        buf = self.momentum.get(name)
        buf = grad.clone() if buf is None else buf.mul_(m).add_(grad)
        self.momentum[name] = buf
        return start - lr * (grad + m * buf)

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "start": dict(self.start),
            "momentum": dict(self.momentum),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.round = int(state["round"])
        self.start = {k: v.clone() for k, v in state["start"].items()}
        self.momentum = {k: v.clone() for k, v in state["momentum"].items()}


def _check_like(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> None:
    if set(want) != set(got):
        missing = sorted(set(want) ^ set(got))[:3]
        raise ParamSetError(
            f"a contribution's parameters differ from this model's ({missing} ...): every "
            "replica group must run the same model"
        )
    for k, v in want.items():
        if got[k].shape != v.shape:
            raise ParamSetError(
                f"parameter {k} has shape {tuple(got[k].shape)} in a contribution, "
                f"{tuple(v.shape)} here: every replica group must run the same model"
            )


def encode(params: Mapping[str, torch.Tensor]) -> bytes:
    """``params`` in the wire format (module docstring)."""
    header: list[list[Any]] = []
    bodies: list[bytes] = []
    for name, t in params.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ParamSetError(f"parameter {name} is {dtype}: async syncs float tensors only")
        raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        header.append([name, dtype, list(t.shape), len(raw)])
        bodies.append(raw)
    head = json.dumps({"v": FORMAT_VERSION, "tensors": header}).encode()
    return struct.pack(">I", len(head)) + head + b"".join(bodies)


def decode(blob: bytes) -> Params:
    """The parameter set in ``blob``; :class:`ParamSetError` when it is malformed."""
    if len(blob) < 4:
        raise ParamSetError("a parameter set shorter than its header: the store lost data")
    (n,) = struct.unpack(">I", blob[:4])
    if n > _MAX_HEADER or 4 + n > len(blob):
        raise ParamSetError(f"a parameter set's header of {n} bytes overruns it")
    try:
        head = json.loads(blob[4 : 4 + n])
    except ValueError:
        raise ParamSetError("a parameter set's header is not JSON") from None
    if not isinstance(head, dict) or head.get("v") != FORMAT_VERSION:
        raise ParamSetError(
            f"parameter set format {head.get('v') if isinstance(head, dict) else '?'!r}, "
            f"this stalwart reads {FORMAT_VERSION}: every group must run one installation"
        )
    out: Params = {}
    at = 4 + n
    for entry in head.get("tensors", []):
        name, dtype, shape, nbytes = _entry(entry)
        if at + nbytes > len(blob):
            raise ParamSetError(f"parameter {name} overruns its parameter set")
        t = torch.frombuffer(bytearray(blob[at : at + nbytes]), dtype=torch.uint8)
        out[name] = t.view(_DTYPES[dtype]).reshape(shape)
        at += nbytes
    if at != len(blob):
        raise ParamSetError("a parameter set has trailing bytes: the store mixed two writes")
    return out


def _entry(entry: object) -> tuple[str, str, list[int], int]:
    if isinstance(entry, list) and len(entry) == 4:
        name, dtype, shape, nbytes = (cast(Any, x) for x in entry)
        if (
            isinstance(name, str)
            and dtype in _DTYPES
            and isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(nbytes, int)
            and nbytes == math.prod(shape) * _DTYPES[dtype].itemsize
        ):
            return name, dtype, shape, nbytes
    raise ParamSetError(f"a parameter set's entry {entry!r} is malformed")
