"""Text output shared by the simulator commands: tables, minutes, JSON-safe values."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["clean", "header", "minutes", "table"]


def clean(obj: Any) -> Any:
    """JSON-safe copy: NaN and inf become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    return obj


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60.0:.2f}"


def header(sc: Any, replicas: int) -> str:
    days = sc.horizon_s / 86400.0
    return (
        f"{sc.name}: {sc.cluster.gpus:,} GPUs ({sc.cluster.nodes:,} nodes, "
        f"{sc.cluster.spare_nodes} spares), {days:g} days, MTBF {sc.mtbf_s / 3600.0:.2f} h, "
        f"{sc.failures.distribution} failures, {replicas} replicas\nsource: {sc.source or '-'}"
        + control_plane_line(sc)
    )


def control_plane_line(sc: Any) -> str:
    """The control plane's share of a recovery's RTO (a crash, flash restart from memory),
    and whether the curve was extrapolated to this node count ("" without a curve)."""
    curve = sc.control_plane
    if curve is None:
        return ""
    c = sc.recovery_costs()
    rto = c.detect_crash_s + c.control_plane_s + c.flash_restart_s + c.restore_memory_s
    share = c.control_plane_s / rto if rto > 0 else 0.0
    beyond = (
        f"extrapolated linearly past the {curve.n_max:,} nodes measured"
        if curve.extrapolated(sc.cluster.nodes)
        else f"measured up to {curve.n_max:,} nodes"
    )
    return (
        f"\ncontrol plane: {c.control_plane_s:.1f} s of each recovery at {sc.cluster.nodes:,} "
        f"nodes, {100 * share:.0f}% of a crash's flash RTO ({rto:.1f} s); {beyond}"
    )
