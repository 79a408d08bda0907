"""Elastic convergence: after each resumption, how many steps until the loss is back
within a band of a reference run's loss curve.

Why per resumption and after it in time: after a rollback the same step numbers are run
again, so only the losses logged after the resumption say whether the recovered (and
perhaps resharded) job trains like the reference; the earlier ones are history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.metrics.events import Event
from stalwart.metrics.goodput import Resume

__all__ = ["Convergence", "convergence", "loss_curve"]


def loss_curve(events: Sequence[Event]) -> dict[int, float]:
    """Step -> loss, the last value logged for each step (what the final model saw)."""
    return {int(e["step"]): float(e["value"]) for e in events if e.kind == "loss"}


@dataclass(frozen=True)
class Convergence:
    resume_t: float
    resume_step: int
    cause: str
    world_size: int
    compared: int  # losses after this resumption that the reference also has
    steps_to_converge: int | None  # None: never back within the band
    max_rel_deviation: float | None


def _within(v: float, ref: float, rel: float, abs_: float) -> bool:
    return abs(v - ref) <= abs_ + rel * abs(ref)


def convergence(
    events: Sequence[Event],
    resumes: Sequence[Resume],
    reference: dict[int, float],
    *,
    rel_band: float = 0.05,
    abs_band: float = 0.0,
    hold: int = 3,
) -> list[Convergence]:
    """For each resumption, the steps from its first step to the first logged step from
    which ``hold`` consecutive losses lie within ``abs_band + rel_band * |reference|``."""
    losses = [e for e in events if e.kind == "loss"]
    out: list[Convergence] = []
    for n, r in enumerate(resumes):
        stop = resumes[n + 1].t if n + 1 < len(resumes) else float("inf")
        seg = [
            (int(e["step"]), float(e["value"]))
            for e in losses
            if r.t <= e.t < stop and int(e["step"]) in reference
        ]
        ok = [_within(v, reference[s], rel_band, abs_band) for s, v in seg]
        found: int | None = None
        for i in range(len(seg)):
            if all(ok[i : i + hold]):
                found = seg[i][0] - r.step
                break
        devs = [abs(v - reference[s]) / abs(reference[s]) for s, v in seg if reference[s] != 0]
        out.append(
            Convergence(
                r.t, r.step, r.cause, r.world_size, len(seg), found, max(devs) if devs else None
            )
        )
    return out
