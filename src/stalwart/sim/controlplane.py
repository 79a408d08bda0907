"""The control plane's share of a recovery as a function of the job's node count.

Every recovery waits, after the fault is detected, until every survivor holds the new
generation and the agreed restore step: the control plane's round trips and the
coordinator's CPU for N members. ``bench/scale.py`` measures that time (``loss_to_agreement_s``)
at several N; a :class:`ControlPlaneCurve` holds those points, and a scenario that carries
one prices each recovery with the curve at its own node count
(:meth:`stalwart.sim.engine.Scenario.recovery_costs`). Between measured points the cost is
interpolated linearly in N; beyond the largest measured N it is extrapolated linearly
from the last two points (the design's bound: O(N) total work, O(1) rounds), and
:meth:`ControlPlaneCurve.extrapolated` says so. The presets carry :data:`MEASURED`.

``curve_from_bench`` reads bench/scale.py's final JSON line (its ``curves``) to build a
curve from a new run, leaving out the rows where the emulator itself was saturated (it
kept less than 90% of its step rate: those latencies are the emulator's).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError

__all__ = ["MEASURED", "ControlPlaneCurve", "curve_from_bench", "load_curve"]


@dataclass(frozen=True)
class ControlPlaneCurve:
    """``points``: (nodes, seconds from a node's loss to every survivor's agreement)."""

    points: tuple[tuple[int, float], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a control-plane curve needs at least one measured point")
        nodes = [n for n, _ in self.points]
        if nodes != sorted(set(nodes)) or nodes[0] < 1:
            raise ConfigError("control-plane points must have distinct node counts >= 1, sorted")
        for n, s in self.points:
            if not (math.isfinite(s) and s >= 0):
                raise ConfigError(f"control-plane cost at {n} nodes must be >= 0 s, got {s!r}")

    @property
    def n_max(self) -> int:
        """The largest node count measured."""
        return self.points[-1][0]

    def extrapolated(self, nodes: int) -> bool:
        """True when ``nodes`` lies beyond the measured curve."""
        return nodes > self.n_max

    def at(self, nodes: int) -> float:
        """Seconds of control plane in one recovery of a job of ``nodes`` nodes."""
        pts = self.points
        if nodes <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if nodes <= pts[0][0] else self._beyond(nodes)
        for (n0, s0), (n1, s1) in itertools.pairwise(pts):
            if nodes <= n1:
                return s0 + (s1 - s0) * (nodes - n0) / (n1 - n0)
        return self._beyond(nodes)

    def _beyond(self, nodes: int) -> float:
        if len(self.points) == 1:
            return self.points[0][1]
        (n0, s0), (n1, s1) = self.points[-2:]
        slope = max(0.0, (s1 - s0) / (n1 - n0))  # never cheaper with more nodes
        return s1 + slope * (nodes - n1)


MEASURED = ControlPlaneCurve(
    points=((16, 0.025), (64, 0.076), (128, 0.224), (256, 0.268), (512, 0.595), (1024, 1.386)),
    source=(
        "bench/scale.py 2026-12-05, embedded store, a node's process killed: the last "
        "survivor's agreement (docs/scale.md, ninth round; every node's client on the "
        "same 2 cores as the store, a quiet machine: an upper bound for a real cluster; "
        "at 1,024 nodes the emulator's CPU bounds it, 2.4 s on 2 cores against the "
        "store's 0.5 s)"
    ),
)


def curve_from_bench(
    data: Any, backend: str = "embedded", where: str = "bench"
) -> ControlPlaneCurve:
    """The curve of ``backend`` in bench/scale.py's final JSON object (its ``curves``)."""
    rows = data.get("curves", {}).get(backend) if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"{where}: no {backend!r} curve; pass bench/scale.py's final JSON line")
    points = sorted(
        (int(r["n"]), float(r["loss_to_agreement_s"]))
        for r in rows
        if isinstance(r, dict)
        and "error" not in r
        and "loss_to_agreement_s" in r
        and not r.get("emulator_saturated")  # measured the emulator, not the control plane
    )
    if not points:
        raise ConfigError(f"{where}: the {backend!r} curve has no completed row")
    return ControlPlaneCurve(tuple(points), f"{where} ({backend})")


def load_curve(path: str | Path, backend: str = "embedded") -> ControlPlaneCurve:
    """The curve in a file of bench/scale.py's output (its last JSON line with ``curves``)."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read {p}: {err.strerror}; check the path") from err
    for line in reversed(lines):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "curves" in data:
            return curve_from_bench(data, backend, str(p))
    raise ConfigError(f"{p} holds no bench/scale.py final line (a JSON object with 'curves')")
