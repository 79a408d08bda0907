"""Checking one worker-contract field (runtime/env.py): its type, bounds and choices."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING
from typing import Any

from stalwart.errors import ContractError

__all__ = ["check_field"]


def check_field(
    name: str, meta: Mapping[str, Any], default: object, value: object, where: str, fix: str
) -> None:
    """``value`` has its field's type and lies within its bounds (``where`` names the
    variable in the error, ``fix`` says how to set it right)."""
    if default is MISSING:  # pragma: no cover - every field has a default
        return
    if name == "store":
        ok = value is None or (
            isinstance(value, tuple)
            and len(value) == 2
            and isinstance(value[0], str)
            and type(value[1]) is int
        )
        want = "None or (host, port)"
    elif isinstance(default, bool):
        ok, want = isinstance(value, bool), "a boolean"
    elif isinstance(default, int):
        ok, want = type(value) is int, "an integer"
    elif isinstance(default, float):
        ok = type(value) in (int, float) and math.isfinite(float(value))  # type: ignore[arg-type]
        want = "a finite number"
    else:
        ok, want = isinstance(value, str), "a string"
        choices = meta.get("choices", ())
        if ok and choices and value not in choices:
            ok, want = False, f"one of {', '.join(choices)}"
    if not ok:
        raise ContractError(f"{where}={value!r} is not {want}: {fix}")
    low = meta["low"]
    if low is None:
        return
    assert isinstance(value, int | float)
    if value < low or (meta["gt"] and value == low):
        bound = f"> {low:g}" if meta["gt"] else f">= {low:g}"
        raise ContractError(f"{where}={value!r} is out of bounds (need {bound}): {fix}")
