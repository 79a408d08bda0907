"""The benchmarks' shared harness (issue 34): repeated, paired measurements with their
spread, the load they ran under, and a validity that a verdict must pass.

A bench hands :func:`repeat` one callable, ``measure(rep) -> figures``, that runs ONE
repetition of the whole comparison (ours, the peer, the floor, one after the other:
:func:`interleaved` gives the order, reversed on every other repetition so that neither
side always runs first on a machine whose load drifts) and returns its figures: a dict of
numbers (nested dicts allowed; other values are kept as they are). The harness runs it
``reps`` times and reads the 1-minute load average before and after each repetition.

:meth:`Summary.document` is the bench's final JSON line: the figures' keys as the bench
always printed them, each number now the median over the repetitions, and beside them

- ``spread``: per figure (dotted path, ``routes.flash.ettr``) its ``median``, ``min``,
  ``max``, ``n`` (repetitions that gave a number) and ``valid``;
- ``valid`` (bool) and ``invalid`` (the reasons): a repetition failed (raised), a
  fault-trace run met fewer faults than asked (the measure says so with
  :class:`Invalid` entries in its figures' ``"_invalid"`` list, or
  :func:`fault_shortfall`), or the load from *outside* the bench changed more than
  :data:`LOAD_JUMP` x between the two halves of a repetition (bench/_outside_load.py:
  runnable threads that are not the bench's; the load average counts the bench's own
  workers, which took a first repetition on a quiet machine from 1.8 to 5.5 by
  themselves; loads below :data:`LOAD_FLOOR` count as the floor: an idle machine's
  0.1 -> 0.3 is not a change of regime);
- ``reps``, ``load`` (the load average before/after each repetition, and the outside
  load of its two halves), ``versions`` (python, torch,
  torchft, etcd where present) and ``machine`` (cores, memory).

A verdict (a "best", a pass/fail against a mark) reads its figure through
:meth:`Summary.figure`, which is None for a figure that is invalid: no verdict from a
repetition that failed or a run that measured nothing.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

from _outside_load import OutsideLoad

__all__ = [
    "HARNESS_VERSION",
    "LOAD_FLOOR",
    "LOAD_JUMP",
    "Invalid",
    "Rep",
    "Sampled",
    "Summary",
    "add_arguments",
    "fault_shortfall",
    "interleaved",
    "machine",
    "repeat",
    "versions",
]

HARNESS_VERSION = 1
LOAD_JUMP = 2.0  # a repetition whose load moved more than this factor is not a fair pair
LOAD_FLOOR = 1.0  # loads under one busy core count as one
T = TypeVar("T")


class Sampled(float):
    """A figure that is the median of repetitions the bench took itself, inside one
    harness repetition (bench/checkpoint.py's interleaved pairs: building its 1.5 GB
    state once for all of them). It reads as that median; :class:`Summary` takes its
    spread (min, max, n) from the samples, so the table shows the repetitions behind it
    rather than n = 1."""

    samples: tuple[float, ...]

    def __new__(cls, samples: Iterable[float]) -> Sampled:
        values = tuple(float(x) for x in samples)
        if not values:
            raise ValueError("a sampled figure needs at least one sample")
        obj = super().__new__(cls, statistics.median(values))
        obj.samples = values
        return obj


@dataclass(frozen=True)
class Invalid:
    """A figure (dotted path prefix; ``""``: every figure) that a repetition cannot vouch
    for, and why."""

    prefix: str
    reason: str


@dataclass
class Rep:
    """One repetition: its figures (flattened to dotted paths), its load, what went wrong."""

    index: int
    load_before: float
    load_after: float
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    invalid: list[Invalid] = field(default_factory=list)
    outside: tuple[float, float] | None = None
    """Mean runnable threads outside the bench in the repetition's first and second half
    (bench/_outside_load.py); None where not sampled."""


def add_arguments(p: Any, default_reps: int = 3) -> None:
    """``--reps N`` on a bench's argparse parser."""
    p.add_argument(
        "--reps",
        type=int,
        default=default_reps,
        help=f"paired repetitions, median and spread over them (default {default_reps}; "
        "1 for a quick look, which has no spread)",
    )


def interleaved(arms: Sequence[T], rep: int) -> list[T]:
    """The arms in the order to run them in repetition ``rep``: as given on even
    repetitions, reversed on odd ones."""
    return list(arms) if rep % 2 == 0 else list(reversed(arms))


def fault_shortfall(name: str, met: int | None, asked: int) -> Invalid | None:
    """An :class:`Invalid` for ``name`` when a fault-trace run met fewer than ``asked``."""
    if met is not None and met >= asked:
        return None
    got = "an unknown number of" if met is None else str(met)
    return Invalid(name, f"{name}: met {got} faults, fewer than the {asked} asked")


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _flatten(value, path + ".")
        else:
            out[path] = value
    return out


def _number(value: Any) -> bool:
    """A figure: a finite int or float (NaN is "not measured", as None is)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        doc = doc.setdefault(key, {})
    doc[leaf] = value


def _load_reason(rep: Rep) -> str | None:
    """Why the repetition is not a fair pair: the load from outside the bench moved
    between its halves (the load average before -> after where that was not sampled)."""
    first, second = rep.outside or (rep.load_before, rep.load_after)
    lo, hi = sorted((max(first, LOAD_FLOOR), max(second, LOAD_FLOOR)))
    if hi / lo <= LOAD_JUMP:
        return None
    if rep.outside is None:
        return (
            f"repetition {rep.index}: load went {first:.1f} -> {second:.1f} "
            f"(> {LOAD_JUMP:g}x) within the pair"
        )
    return (
        f"repetition {rep.index}: the load from outside the bench went {first:.1f} -> "
        f"{second:.1f} runnable threads (> {LOAD_JUMP:g}x) within the pair"
    )


@dataclass
class Summary:
    """The repetitions of one bench and what they add up to."""

    reps: list[Rep]

    def _reasons(self) -> list[Invalid]:
        out: list[Invalid] = []
        for rep in self.reps:
            if rep.error is not None:
                out.append(Invalid("", f"repetition {rep.index} failed: {rep.error}"))
            why = _load_reason(rep)
            if why is not None:
                out.append(Invalid("", why))
            out += rep.invalid
        return out

    def _paths(self) -> list[str]:
        seen: dict[str, None] = {}
        for rep in self.reps:
            seen |= dict.fromkeys(rep.figures)
        return list(seen)

    def values(self, path: str) -> list[float]:
        """The numbers the repetitions gave for ``path`` (None and missing left out)."""
        out: list[float] = []
        for rep in self.reps:
            got = rep.figures.get(path)
            if isinstance(got, Sampled):
                out += [v for v in got.samples if math.isfinite(v)]  # its own repetitions
            elif _number(got):
                out.append(float(got))
        return out

    def _counts(self, path: str) -> bool:
        got = [rep.figures.get(path) for rep in self.reps]
        return all(isinstance(v, int) for v in got if _number(v))

    def invalid_reason(self, path: str) -> str | None:
        """Why ``path`` is invalid (the first reason), None when it is valid."""
        for inv in self._reasons():
            if inv.prefix == "" or path == inv.prefix or path.startswith(inv.prefix + "."):
                return inv.reason
        return None

    def figure(self, path: str) -> float | None:
        """The median of ``path`` for a verdict: None when invalid or never measured."""
        vals = self.values(path)
        if not vals or self.invalid_reason(path) is not None:
            return None
        return float(statistics.median(vals))

    def document(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The final JSON line (module docstring); ``extra`` (verdicts computed through
        :meth:`figure`, notes) is merged in on top."""
        doc: dict[str, Any] = {}
        spread: dict[str, dict[str, Any]] = {}
        for path in self._paths():
            vals = self.values(path)
            if vals:
                med = float(statistics.median(vals))
                if self._counts(path) and med.is_integer():
                    med = int(med)  # a count stays a count (faults, steps)
                _set(doc, path, med)
                spread[path] = {
                    "median": med,
                    "min": min(vals),
                    "max": max(vals),
                    "n": len(vals),
                    "valid": self.invalid_reason(path) is None,
                }
            else:  # not a number: the last repetition's value (a note, a list, None)
                last = [r.figures[path] for r in self.reps if path in r.figures]
                _set(doc, path, None if isinstance(last[-1], float) else last[-1])
        reasons = list(dict.fromkeys(inv.reason for inv in self._reasons()))
        doc |= dict(extra or {})
        doc |= {
            "spread": spread,
            "valid": not reasons,
            "invalid": reasons,
            "reps": len(self.reps),
            "load": [
                {
                    "rep": r.index,
                    "before": round(r.load_before, 2),
                    "after": round(r.load_after, 2),
                    "outside": None if r.outside is None else [round(x, 2) for x in r.outside],
                }
                for r in self.reps
            ],
            "versions": versions(),
            "machine": machine(),
            "harness": HARNESS_VERSION,
        }
        return doc


def repeat(
    measure: Callable[[int], Mapping[str, Any]],
    reps: int,
    *,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
    log: Callable[[str], None] = lambda line: print(line, flush=True),
    outside: Callable[[], OutsideLoad] | None = OutsideLoad,
) -> Summary:
    """Run ``measure(rep)`` for rep 0..reps-1, each between two load readings; a
    repetition that raises is recorded as failed (its traceback's last line) and the next
    one runs. The figures' ``"_invalid"`` entry (a list of :class:`Invalid`) is taken out
    of the figures and kept as the repetition's reasons."""
    if reps < 1:
        raise ValueError(f"--reps takes a positive count, got {reps}; give --reps 1 or more")
    out: list[Rep] = []
    for i in range(reps):
        before, t0 = load(), time.monotonic()
        sampler = None if outside is None else outside().start()
        figures: dict[str, Any] = {}
        error: str | None = None
        invalid: list[Invalid] = []
        try:
            got = dict(measure(i))
            invalid = [x for x in got.pop("_invalid", []) if isinstance(x, Invalid)]
            figures = _flatten(got)
        except Exception as exc:  # a failed repetition is a recorded figure, not the end
            error = traceback.format_exception_only(exc)[-1].strip()
        halves = None if sampler is None else sampler.stop()
        rep = Rep(i, before, load(), time.monotonic() - t0, figures, error, invalid, halves)
        out.append(rep)
        state = f"failed: {error}" if error else f"{len(figures)} figures"
        seen = "" if halves is None else f", outside {halves[0]:.1f} -> {halves[1]:.1f}"
        log(
            f"rep {i + 1}/{reps}: {state} ({rep.seconds:.0f} s, "
            f"load {before:.1f} -> {rep.load_after:.1f}{seen})"
        )
    return Summary(out)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _etcd_version() -> str | None:
    etcd = shutil.which("etcd")
    if etcd is None:
        return None
    try:
        got = subprocess.run([etcd, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = got.stdout.splitlines()[:1]
    return first[0].split(":", 1)[-1].strip() if first else None


def versions() -> dict[str, str | None]:
    """python, stalwart, torch, torchft and etcd (None: not installed here)."""
    return {
        "python": platform.python_version(),
        "stalwart": _version("stalwart"),
        "torch": _version("torch"),
        "torchft": _version("torchft"),
        "etcd": _etcd_version(),
    }


def _mem_gb(lines: Iterable[str]) -> float | None:
    for line in lines:
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20), 1)
    return None


def machine() -> dict[str, Any]:
    """Cores (usable by this process, and online), memory (GiB), the platform."""
    try:
        with open("/proc/meminfo") as f:
            mem = _mem_gb(f)
    except OSError:
        mem = None
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpus_online": os.cpu_count(),
        "memory_gb": mem,
        "platform": platform.platform(),
    }
