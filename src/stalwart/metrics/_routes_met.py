"""Did a faulted route run meet its trace? (docs/routes.md, "A run that met no fault")

The trace's instants are seconds after the job's first step; the job is sized in steps. On
a fast machine a job can reach its target before the trace's first instant: it ran fault
free, and its ETTR (about 1.0) and time to target would pass for a faulted run's. A fault
figure counts only from a run that met its faults, so such a run's figures are not
shown; the faults of a long trace (``--horizon``) that fall after the job's end are the
trace outliving the job, and are only counted. A fault that fired once member 0 had
recorded the target step (the job's last step: it struck a rank on its way out) is not
one of the faults the run met either (:func:`before_target`): it counts unfired, and the
run, its target kept, counts as finished whatever that kill made the launcher exit with.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FaultsMet", "before_target", "faults_met"]


@dataclass(frozen=True)
class FaultsMet:
    """How a faulted run met its trace: ``met`` False when none of its faults fired."""

    planned: int  # the trace's faults
    fired: int
    met: bool
    note: str  # "" when every planned fault fired


def faults_met(planned_at: tuple[float, ...], fired: int, span_s: float | None) -> FaultsMet:
    """``planned_at``: the trace's instants (s after the first step); ``fired``: how many
    struck; ``span_s``: the run's first step record to its last (None: under two)."""
    planned = sorted(planned_at)
    unfired = planned[fired:]  # the trace fires in order: the later instants are the missed
    if not unfired:
        return FaultsMet(len(planned), fired, True, "")
    ran = "its steps never began" if span_s is None else f"its steps ran {span_s:.1f} s"
    if fired == 0:
        which = "fault" if len(planned) == 1 else f"{len(planned)} faults"
        first = "the fault" if len(planned) == 1 else "the first"
        note = (
            f"not a faulted run: the trace's {which} never fired (the job ended first: "
            f"{ran}, {first} was due at {unfired[0]:.1f} s); figures not shown: raise "
            "--target or start the trace earlier"
        )
        return FaultsMet(len(planned), 0, False, note)
    note = (
        f"{len(unfired)} of the trace's {len(planned)} faults never fired: the job ended "
        f"first ({ran}; the next was due at {unfired[0]:.1f} s)"
    )
    return FaultsMet(len(planned), fired, True, note)


def before_target(steps: Iterable[tuple[int, float]], target: int, fired: tuple[float, ...]) -> int:
    """How many of the faults ``fired`` (wall clock, in order) struck before member 0
    recorded step ``target`` (``steps``: its records' (step, wall clock)); the rest fired
    at or after the job's last step. All of them when the target was never recorded."""
    done = min((t for step, t in steps if step >= target), default=None)
    return len(fired) if done is None else sum(1 for t in fired if t < done)
