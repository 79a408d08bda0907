"""Calibration files: costs measured on a real run, to replace the simulator's defaults.

Format (JSON, one object, version 2)::

    {
      "format": "stalwart-calibration",
      "version": 2,
      "source": {"run_dir": "runs/job7", "created": "2026-01-01T00:00:00Z", "events": 1234},
      "costs": {"detect_crash_s": 0.4, "flash_restart_s": 2.1, "snapshot_stall_s": 0.05, ...},
      "measured": {"ettr": 0.93, "wall_s": 600.0, "failures": 4, "gpus": 4, "nodes": 2,
                   "mtbf_s": 150.0, "step_s": 0.05, "persist_bytes_per_s": 2.1e8},
      "replay": {"strategy": "flash", "startup_s": 0.9, "train_s": 38.0, "tail_s": 0.8,
                 "step_s": 0.055, "efficiency": 0.98, "snapshot_every": 13,
                 "interval_s": 0.72, "persist_every": 0,
                 "faults": [{"t_s": 9.8, "kind": "crash", "node": false, "step": 150}]}
    }

``costs`` keys are the fields of :class:`~stalwart.sim.job.RecoveryCosts` and the timing fields
of :class:`~stalwart.sim.job.JobConfig` (``snapshot_stall_s``, ``sync_save_s``, ``persist_s``),
all seconds >= 0; any subset may be given, unknown keys are an error (a typo must not be silently
ignored). ``source`` is free-form provenance (strings and numbers). ``measured`` is optional: the
run's own ETTR and shape, so a simulation of the same configuration can be compared with it
(``mtbf_s``, ``step_s`` and ``persist_bytes_per_s`` are optional and may be null: not measured).
``replay`` is optional: what the simulator needs to replay that run (its length, step time,
snapshot cadence and the times of its faults; :mod:`stalwart.sim.calibrate`).

Versions: 1 had no ``replay`` and only the five required ``measured`` keys; 2 added
``replay``; 3 added the optional ``replay.replica_groups`` and ``replay.sync_every`` of an
async run (integers >= 1 and >= 0; absent: 1 and 0). This reader reads all three. A newer
``version`` is refused with a message to upgrade stalwart. The writer is
:func:`calibration_to_dict`; ``stalwart calibrate RUN_DIR`` derives a file from a run's event log.
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
from stalwart.userfile import open_regular

__all__ = [
    "CALIBRATION_FORMAT",
    "CALIBRATION_VERSION",
    "COST_KEYS",
    "Calibration",
    "MeasuredRun",
    "Replay",
    "ReplayFault",
    "apply_calibration",
    "calibration_to_dict",
    "load_calibration",
    "parse_calibration",
]

CALIBRATION_FORMAT = "stalwart-calibration"
CALIBRATION_VERSION = 3

_JOB_KEYS = ("snapshot_stall_s", "sync_save_s", "persist_s")
_RECOVERY_KEYS = tuple(f.name for f in fields(RecoveryCosts))
COST_KEYS: tuple[str, ...] = _RECOVERY_KEYS + _JOB_KEYS


_FAULT_KINDS = ("crash", "hang", "lease")


@dataclass(frozen=True)
class MeasuredRun:
    """What the calibrated run itself measured (``None``: not measured)."""

    ettr: float
    wall_s: float
    failures: int
    gpus: int
    nodes: int
    mtbf_s: float | None = None
    step_s: float | None = None
    persist_bytes_per_s: float | None = None


@dataclass(frozen=True)
class ReplayFault:
    """One failure of the calibrated run: when (seconds after training started), how it was
    detected (``crash``, ``hang`` or ``lease``), whether it took a whole node, and the step
    chaos injected it at (``at=step:N``; ``None`` for a fault at a time, or a natural one)."""

    t_s: float
    kind: str
    node: bool
    step: int | None = None


@dataclass(frozen=True)
class Replay:
    """The calibrated run's configuration, as the simulator replays it.

    Wall time = ``startup_s`` (launch to the first step) + ``train_s`` (first step to the end
    of the last) + ``tail_s`` (shutdown). ``step_s`` is wall seconds per step inside a step
    batch (snapshot stalls excluded), of which ``efficiency`` is step compute (the rest is
    per-step overhead: data loading, logging). A snapshot every ``snapshot_every`` steps, i.e.
    every ``interval_s`` seconds of training; a committed persist every ``persist_every`` steps
    (0: none).
    """

    strategy: str
    startup_s: float
    train_s: float
    tail_s: float
    step_s: float
    efficiency: float
    snapshot_every: int
    interval_s: float
    persist_every: int = 0
    faults: tuple[ReplayFault, ...] = ()
    replica_groups: int = 1
    """``--strategy async``: how many replica groups trained (a fault stops one of them)."""
    sync_every: int = 0
    """``--strategy async``: steps between the groups' synchronisations (0: not async, or
    fewer than two synchronisations logged). A failed group loses the work since its last
    one and rejoins at the next, so the replay needs both to price a fault."""


@dataclass(frozen=True)
class Calibration:
    costs: dict[str, float]
    source: dict[str, str | int | float]
    measured: MeasuredRun | None = None
    replay: Replay | None = None


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
    optional = ("mtbf_s", "step_s", "persist_bytes_per_s")
    missing = [k for k in need if k not in raw]
    if missing:
        raise ConfigError(f"{where}: 'measured' lacks {', '.join(missing)}; add them or drop it")
    extra = sorted(set(raw) - set(need) - set(optional))
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

    def opt(key: str) -> float | None:
        value = raw.get(key)
        return None if value is None else _number(where, f"measured.{key}", value)

    return MeasuredRun(
        ettr,
        _number(where, "measured.wall_s", raw["wall_s"]),
        counts["failures"],
        counts["gpus"],
        counts["nodes"],
        mtbf_s=opt("mtbf_s"),
        step_s=opt("step_s"),
        persist_bytes_per_s=opt("persist_bytes_per_s"),
    )


def _replay(where: str, raw: Any, version: int) -> Replay:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'replay' must be an object, got {type(raw).__name__}")
    nums = ("startup_s", "train_s", "tail_s", "step_s", "efficiency", "interval_s")
    need = ("strategy", *nums, "snapshot_every", "persist_every", "faults")
    missing = [k for k in need if k not in raw]
    if missing:
        raise ConfigError(f"{where}: 'replay' lacks {', '.join(missing)}; add them or drop it")
    optional = ("replica_groups", "sync_every") if version >= 3 else ()
    extra = sorted(set(raw) - set(need) - set(optional))
    if extra:
        raise ConfigError(f"{where}: unknown key(s) in 'replay': {', '.join(extra)}")
    if not isinstance(raw["strategy"], str):
        raise ConfigError(f"{where}: replay.strategy must be a strategy name")
    v = {k: _number(where, f"replay.{k}", raw[k]) for k in nums}
    if v["train_s"] <= 0 or v["step_s"] <= 0 or v["interval_s"] <= 0:
        raise ConfigError(f"{where}: replay.train_s, step_s and interval_s must be > 0")
    if v["efficiency"] > 1:
        raise ConfigError(f"{where}: replay.efficiency is a ratio in [0, 1], got {v['efficiency']}")
    every = raw["snapshot_every"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{where}: replay.snapshot_every must be an integer >= 1, got {every!r}")
    pe = raw["persist_every"]
    if isinstance(pe, bool) or not isinstance(pe, int) or pe < 0:
        raise ConfigError(f"{where}: replay.persist_every must be an integer >= 0, got {pe!r}")
    if not isinstance(raw["faults"], list):
        raise ConfigError(f"{where}: replay.faults must be a list of faults")
    faults = []
    for n, f in enumerate(raw["faults"]):
        at = f"replay.faults[{n}]"
        if not isinstance(f, dict) or set(f) != {"t_s", "kind", "node", "step"}:
            raise ConfigError(f"{where}: {at} must be an object with t_s, kind, node and step")
        if f["kind"] not in _FAULT_KINDS or not isinstance(f["node"], bool):
            raise ConfigError(
                f"{where}: {at}: kind must be one of {', '.join(_FAULT_KINDS)} and node a boolean"
            )
        step = f["step"]
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"{where}: {at}.step must be null or an integer >= 0, got {step!r}")
        t_s = _number(where, f"{at}.t_s", f["t_s"])
        faults.append(ReplayFault(t_s, f["kind"], f["node"], step))
    groups, sync = _async_fields(where, raw)
    return Replay(
        raw["strategy"],
        v["startup_s"],
        v["train_s"],
        v["tail_s"],
        v["step_s"],
        v["efficiency"],
        every,
        v["interval_s"],
        pe,
        tuple(sorted(faults, key=lambda f: f.t_s)),
        groups,
        sync,
    )


def _async_fields(where: str, raw: dict[str, Any]) -> tuple[int, int]:
    """``replay.replica_groups`` and ``replay.sync_every`` (version 3; absent: 1 and 0)."""
    groups, sync = raw.get("replica_groups", 1), raw.get("sync_every", 0)
    for key, value, low in (("replica_groups", groups, 1), ("sync_every", sync, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 10**6:
            raise ConfigError(
                f"{where}: replay.{key} must be an integer in {low}..1000000, got {value!r}"
            )
    return groups, sync


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
    extra = sorted(set(data) - {"format", "version", "source", "costs", "measured", "replay"})
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
    if version < 2 and "replay" in data:
        raise ConfigError(f"{where}: 'replay' needs version 2; set \"version\": 2")
    replay = _replay(where, data["replay"], version) if "replay" in data else None
    return Calibration(costs=costs, source=dict(source), measured=measured, replay=replay)


_CAL_FIX = "pass a JSON file written by `stalwart calibrate`"


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file."""
    p = Path(path)
    try:
        with open_regular(p, what="the calibration", fix=_CAL_FIX) as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"calibration file {p} is not UTF-8 text ({err.reason})") from err
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
    """The JSON object :func:`parse_calibration` reads back (the current version)."""
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
            "mtbf_s": m.mtbf_s,
            "step_s": m.step_s,
            "persist_bytes_per_s": m.persist_bytes_per_s,
        }
    r = calibration.replay
    if r is not None:
        out["replay"] = {
            "strategy": r.strategy,
            "startup_s": r.startup_s,
            "train_s": r.train_s,
            "tail_s": r.tail_s,
            "step_s": r.step_s,
            "efficiency": r.efficiency,
            "snapshot_every": r.snapshot_every,
            "interval_s": r.interval_s,
            "persist_every": r.persist_every,
            "faults": [
                {"t_s": f.t_s, "kind": f.kind, "node": f.node, "step": f.step} for f in r.faults
            ],
        }
        if r.replica_groups > 1 or r.sync_every > 0:
            out["replay"] |= {"replica_groups": r.replica_groups, "sync_every": r.sync_every}
    return out
