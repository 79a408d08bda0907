"""Checking one worker-contract field (contract/env.py): its type, bounds and choices."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import MISSING
from typing import Any

from stalwart.errors import ContractError

__all__ = ["INTEGER", "check_field", "check_names"]

INTEGER = re.compile(r"-?[0-9]+", re.ASCII)
"""An integer as a launcher writes it: ASCII digits only (``int()`` also takes '٣', '²'
is refused by it but passes ``str.isdigit()``, ' 3' and '3_0')."""
_RUN = re.compile(r"[0-9a-f]{0,64}", re.ASCII)
_JOB_MAX = 200


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
    low, lt = meta["low"], meta.get("lt")
    if low is not None:
        assert isinstance(value, int | float)
        if value < low or (meta["gt"] and value == low):
            bound = f"> {low:g}" if meta["gt"] else f">= {low:g}"
            raise ContractError(f"{where}={value!r} is out of bounds (need {bound}): {fix}")
    if lt is not None:
        assert isinstance(value, int | float)
        if value >= lt:
            raise ContractError(f"{where}={value!r} is out of bounds (need < {lt:g}): {fix}")


def check_names(job: str, shm_run: str, fix: str) -> None:
    """The job id and the run id go into store keys and /dev/shm names: printable ASCII
    without whitespace, ``/`` or ``\\`` (so never a path, a NUL or a control character),
    at most 200 characters; the run id is hex digits (contract/shm_names.py draws 16), or empty."""
    if not (
        0 < len(job) <= _JOB_MAX
        and job.isascii()
        and job.isprintable()
        and not any(c in job for c in " /\\")
    ):
        raise ContractError(
            f"TORCHELASTIC_RUN_ID={job[:_JOB_MAX]!r} is not a job id (1..{_JOB_MAX} printable "
            "ASCII characters without spaces, '/' or '\\'): the launcher sets it; give "
            "--rdzv-id such a name"
        )
    if not _RUN.fullmatch(shm_run):
        raise ContractError(
            f"STALWART_CONTRACT.shm_run={shm_run[:40]!r} is not a run id (hex digits): {fix}"
        )
