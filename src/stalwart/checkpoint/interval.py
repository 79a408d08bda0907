"""How often to checkpoint: Young's and Daly's optimum intervals.

Why here: the interval is the checkpoint's own policy. A worker under
``--persist-every -1`` picks its persist cadence with :func:`daly_interval`, and the
simulator's planner (sim/analytic.py, docs/simulator.md) uses the same formula to
recommend one; both import it from this module, which imports nothing but the errors, so
a worker never loads the simulator to time a persist.

Sources: J. W. Young, CACM 17(9), 1974 (``tau = sqrt(2 delta M)``); J. T. Daly, FGCS 22(3),
2006, eq. 37 (``tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18 M)] - delta`` for
``delta < 2M``, else ``tau = M``). ``delta``: seconds one checkpoint costs; ``M``: the mean
time between failures, in seconds.
"""

from __future__ import annotations

import math

from stalwart.errors import ConfigError

__all__ = ["check_inputs", "daly_interval", "young_interval"]


def check_inputs(delta: float, mtbf: float) -> None:
    """:class:`ConfigError` unless ``delta`` is a finite cost >= 0 s and ``mtbf`` > 0 s."""
    if not (math.isfinite(delta) and delta >= 0):
        raise ConfigError(f"checkpoint cost must be a finite number >= 0 s, got {delta!r}")
    if not mtbf > 0:
        raise ConfigError(f"MTBF must be > 0 s, got {mtbf!r}; check the failure rates")


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2 delta M)`` (seconds of compute)."""
    check_inputs(delta, mtbf)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (seconds of compute between checkpoints)."""
    check_inputs(delta, mtbf)
    if math.isinf(mtbf):
        return math.inf
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta
