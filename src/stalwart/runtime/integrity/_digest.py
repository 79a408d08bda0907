"""What the integrity checks read and tamper with: the replicated tensors of a DDP job.

A DDP job's replicas must be bit-identical after every step: the parameters and the
optimizer's state (moments, step counts) are computed from the same averaged gradients.
Buffers are not compared (BatchNorm statistics are each rank's own unless the script
broadcasts them), nor the per-rank RNG or loader position. The order is the model's
parameter order, then each optimizer's ``param_groups`` order: the same on every rank.

The digest is xxh3-64 of the tensors' bytes on the CPU (about the speed of a memory
copy, and xxhash is a core dependency), and for tensors on an accelerator a checksum on
the device (the sum of the tensor's 32-bit words: any single flipped bit changes it),
read back with one synchronisation for all of them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import xxhash

if TYPE_CHECKING:
    from stalwart.chaos import Fault

__all__ = [
    "flip_bit",
    "majority_split",
    "poison",
    "replicated_tensors",
    "state_digest",
    "tamper",
]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replicated_tensors(state: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors every DDP replica holds identically, in a rank-independent order."""
    out: list[torch.Tensor] = []
    for value in state.values():
        if isinstance(value, torch.nn.parallel.DistributedDataParallel):
            out.extend(p.detach() for p in value.module.parameters())
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:
                for p in group["params"]:
                    for t in value.state.get(p, {}).values():
                        if isinstance(t, torch.Tensor):
                            out.append(t.detach())
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if not flat.is_contiguous():  # pragma: no cover - parameters are contiguous
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy().data


def state_digest(tensors: Iterable[torch.Tensor]) -> int:
    """A signed 64-bit digest of ``tensors`` (signed: it travels in an int64 tensor)."""
    h = xxhash.xxh3_64()
    device_sums: list[torch.Tensor] = []
    for t in tensors:
        if t.numel() == 0:
            continue
        if t.device.type == "cpu":
            h.update(_bytes_of(t))
        else:
            words = t.reshape(-1).view(torch.uint8)
            pad = (-words.numel()) % 4
            if pad:
                words = torch.cat([words, words.new_zeros(pad)])
            device_sums.append(words.view(torch.int32).sum(dtype=torch.int64))
    if device_sums:
        h.update(_bytes_of(torch.stack(device_sums).cpu()))
    value = h.intdigest()
    return value - (1 << 64) if value >= 1 << 63 else value


def flip_bit(tensors: list[torch.Tensor], fault: Fault, step: int) -> str:
    """Flip one bit of one element of one of ``tensors`` (chaos ``corrupt``); what was
    not given in the spec is drawn from a generator seeded by the fault and the step, so
    every run flips the same bit. Returns where, for the event."""
    if not tensors:
        return "nothing to corrupt (no replicated tensor)"
    rng = random.Random(fault.id * 1_000_003 + step)
    index = (fault.param if fault.param is not None else rng.randrange(len(tensors))) % len(tensors)
    t = tensors[index]
    width = t.element_size() * 8
    elem = (fault.elem if fault.elem is not None else rng.randrange(max(1, t.numel()))) % max(
        1, t.numel()
    )
    bit = (fault.bit if fault.bit is not None else rng.randrange(width)) % width
    words = t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])
    mask = 1 << bit
    if t.element_size() > 1 and bit == width - 1:
        mask = -mask  # the sign bit of a signed word
    before = t.reshape(-1)[elem].item()
    with torch.no_grad():
        words[elem : elem + 1].bitwise_xor_(torch.tensor(mask, dtype=words.dtype))
    # a signed zero: the next update writes +0.0 back on every replica, nothing to find
    same = before == t.reshape(-1)[elem].item()
    return f"tensor {index} element {elem} bit {bit}" + (" (a signed zero: no change)" * same)


def poison(tensors: list[torch.Tensor]) -> str:
    """Set one element of the first floating-point tensor to NaN (chaos ``nan``)."""
    for index, t in enumerate(tensors):
        if t.is_floating_point() and t.numel() > 0:
            with torch.no_grad():
                t.reshape(-1)[0] = float("nan")
            return f"tensor {index} element 0 = NaN"
    return "nothing to poison (no floating-point replicated tensor)"


def majority_split(digests: list[int]) -> tuple[int | None, list[int]]:
    """(the strict majority's digest or None, the ranks that differ from it: all ranks
    that differ from any other when there is no strict majority)."""
    counts: dict[int, int] = {}
    for d in digests:
        counts[d] = counts.get(d, 0) + 1
    top = max(counts, key=lambda d: counts[d])
    if counts[top] * 2 > len(digests):
        return top, [r for r, d in enumerate(digests) if d != top]
    return None, list(range(len(digests))) if len(counts) > 1 else []


def tamper(state: Mapping[str, Any], fault: Fault, step: int) -> str:
    """Chaos ``corrupt`` (one bit) or ``nan`` on the replicated tensors of ``state`` (not
    a DDP job: the parameters of whatever module is tracked); returns where."""
    tensors = replicated_tensors(state)
    if not tensors:
        modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
        tensors = [p.detach() for m in modules for p in m.parameters()]
    return flip_bit(tensors, fault, step) if fault.kind == "corrupt" else poison(tensors)
