"""Calibration files: costs measured on a real run, to replace the simulator's defaults.

Format (JSON, one object, version 1)::

    {
      "format": "stalwart-calibration",
      "version": 1,
      "source": {"run_dir": "runs/job7", "created": "2026-01-01T00:00:00Z", "events": 1234},
      "costs": {"detect_crash_s": 0.4, "flash_restart_s": 2.1, "snapshot_stall_s": 0.05, ...},
      "measured": {"ettr": 0.93, "wall_s": 600.0, "failures": 4, "gpus": 4, "nodes": 2}
    }

``costs`` keys are the fields of :class:`~stalwart.sim.job.RecoveryCosts` and the timing fields
of :class:`~stalwart.sim.job.JobConfig` (``snapshot_stall_s``, ``sync_save_s``, ``persist_s``),
all seconds >= 0; any subset may be given, unknown keys are an error (a typo must not be silently
ignored). ``source`` is free-form provenance (strings and numbers). ``measured`` is optional: the
run's own ETTR and shape, so a simulation of the same configuration can be compared with it.

A newer ``version`` is refused with a message to upgrade stalwart; the writer is
:func:`calibration_to_dict` (``stalwart calibrate RUN_DIR`` will derive the costs from a run's
event log once the launcher writes one).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError
from stalwart.sim.engine import Scenario
from stalwart.sim.job import JobConfig, RecoveryCosts

__all__ = [
    "CALIBRATION_FORMAT",
    "CALIBRATION_VERSION",
    "COST_KEYS",
    "Calibration",
    "MeasuredRun",
    "apply_calibration",
    "calibration_to_dict",
    "load_calibration",
    "parse_calibration",
]

CALIBRATION_FORMAT = "stalwart-calibration"
CALIBRATION_VERSION = 1

_JOB_KEYS = ("snapshot_stall_s", "sync_save_s", "persist_s")
_RECOVERY_KEYS = tuple(f.name for f in fields(RecoveryCosts))
COST_KEYS: tuple[str, ...] = _RECOVERY_KEYS + _JOB_KEYS


@dataclass(frozen=True)
class MeasuredRun:
    """What the calibrated run itself measured."""

    ettr: float
    wall_s: float
    failures: int
    gpus: int
    nodes: int


@dataclass(frozen=True)
class Calibration:
    costs: dict[str, float]
    source: dict[str, str | int | float]
    measured: MeasuredRun | None = None


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}; fix the file")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _measured(where: str, raw: Any) -> MeasuredRun:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'measured' must be an object, got {type(raw).__name__}")
    need = ("ettr", "wall_s", "failures", "gpus", "nodes")
    missing = [k for k in need if k not in raw]
    if missing:
        raise ConfigError(f"{where}: 'measured' lacks {', '.join(missing)}; add them or drop it")
    extra = sorted(set(raw) - set(need))
    if extra:
        raise ConfigError(f"{where}: unknown key(s) in 'measured': {', '.join(extra)}")
    ettr = _number(where, "measured.ettr", raw["ettr"])
    if ettr > 1:
        raise ConfigError(f"{where}: measured.ettr is a ratio in [0, 1], got {ettr}")
    counts = {}
    for key in ("failures", "gpus", "nodes"):
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: measured.{key} must be an integer >= 0, got {value!r}")
        counts[key] = value
    return MeasuredRun(ettr, _number(where, "measured.wall_s", raw["wall_s"]), **counts)


def parse_calibration(data: Any, where: str = "calibration") -> Calibration:
    """Validate a decoded calibration object; ``where`` names it in error messages."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != CALIBRATION_FORMAT:
        raise ConfigError(
            f"{where}: not a calibration file (format is {data.get('format')!r}, expected "
            f"{CALIBRATION_FORMAT!r}); pass a file written by `stalwart calibrate`"
        )
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"{where}: version must be a positive integer, got {version!r}")
    if version > CALIBRATION_VERSION:
        raise ConfigError(
            f"{where}: calibration version {version} is newer than this stalwart reads "
            f"({CALIBRATION_VERSION}); upgrade stalwart"
        )
    extra = sorted(set(data) - {"format", "version", "source", "costs", "measured"})
    if extra:
        raise ConfigError(f"{where}: unknown top-level key(s) {', '.join(extra)}; remove them")
    raw_costs = data.get("costs", {})
    if not isinstance(raw_costs, dict):
        raise ConfigError(f"{where}: 'costs' must be an object of seconds")
    unknown = sorted(set(raw_costs) - set(COST_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown cost(s) {', '.join(unknown)}; known: {', '.join(COST_KEYS)}"
        )
    costs = {k: _number(where, f"costs.{k}", v) for k, v in raw_costs.items()}
    source = data.get("source", {})
    if not isinstance(source, dict) or not all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in source.values()
    ):
        raise ConfigError(f"{where}: 'source' must be an object of strings and numbers")
    measured = _measured(where, data["measured"]) if "measured" in data else None
    return Calibration(costs=costs, source=dict(source), measured=measured)


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(
            f"cannot read calibration file {p}: {err.strerror}; check the path"
        ) from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"calibration file {p} is not valid JSON (line {err.lineno}: {err.msg})"
        ) from err
    return parse_calibration(data, str(p))


def apply_calibration(scenario: Scenario, calibration: Calibration) -> Scenario:
    """``scenario`` with the measured costs replacing its own."""
    rec = {k: v for k, v in calibration.costs.items() if k in _RECOVERY_KEYS}
    c = calibration.costs
    costs: RecoveryCosts = replace(scenario.costs, **rec)
    job_cfg: JobConfig = replace(
        scenario.job,
        snapshot_stall_s=c.get("snapshot_stall_s", scenario.job.snapshot_stall_s),
        sync_save_s=c.get("sync_save_s", scenario.job.sync_save_s),
        persist_s=c.get("persist_s", scenario.job.persist_s),
    )
    return replace(scenario, costs=costs, job=job_cfg)


def calibration_to_dict(calibration: Calibration) -> dict[str, Any]:
    """The JSON object :func:`parse_calibration` reads back (version 1)."""
    out: dict[str, Any] = {
        "format": CALIBRATION_FORMAT,
        "version": CALIBRATION_VERSION,
        "source": dict(calibration.source),
        "costs": dict(calibration.costs),
    }
    m = calibration.measured
    if m is not None:
        out["measured"] = {
            "ettr": m.ettr,
            "wall_s": m.wall_s,
            "failures": m.failures,
            "gpus": m.gpus,
            "nodes": m.nodes,
        }
    return out
