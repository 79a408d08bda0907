"""Closed forms for periodic checkpointing under exponential failures.

Sources
-------
* J. W. Young, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9), 1974: ``tau = sqrt(2 delta M)``.
* J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3), 2006. Expected wall time to finish ``Ts`` of work with
  checkpoint cost ``delta``, restart cost ``R`` and MTBF ``M`` (failures may strike during the
  checkpoint and during the restart) is ``T = M e^(R/M) (e^((tau+delta)/M) - 1) Ts / tau``
  (his eq. 20); its optimum is approximated by
  ``tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + delta/(18 M)] - delta`` for ``delta < 2M``,
  else ``tau = M`` (his eq. 37). His examples with ``delta`` = 5 min: M = 24 h -> 117 min,
  6 h -> 57 min, 15 min -> 9.1 min.

Young's and Daly's optimum intervals live in stalwart/checkpoint/interval.py (the worker's
``--persist-every -1`` cadence uses Daly's too) and are re-exported here.

Trade-off: these hold for ``restart`` only (every failure rolls back to the last checkpoint and
the whole job pays ``R``); the simulator covers the other strategies, and is checked against
these formulas where both apply (tests/sim/test_fidelity.py).
"""

from __future__ import annotations

import math

from stalwart.checkpoint.interval import check_inputs as _check
from stalwart.checkpoint.interval import daly_interval, young_interval
from stalwart.errors import ConfigError

__all__ = [
    "daly_interval",
    "expected_ettr",
    "expected_wall_time",
    "optimal_interval",
    "young_interval",
]


def expected_wall_time(
    work: float, interval: float, delta: float, restart: float, mtbf: float
) -> float:
    """Daly's expected wall time to complete ``work`` seconds of compute (eq. 20)."""
    _check(delta, mtbf)
    if interval <= 0:
        raise ConfigError(f"checkpoint interval must be > 0 s, got {interval!r}")
    if math.isinf(mtbf):
        return work * (interval + delta) / interval
    return mtbf * math.exp(restart / mtbf) * math.expm1((interval + delta) / mtbf) * work / interval


def expected_ettr(interval: float, delta: float, restart: float, mtbf: float) -> float:
    """Expected effective training time ratio (compute kept / wall time) in the long run."""
    return 1.0 / expected_wall_time(1.0, interval, delta, restart, mtbf)


def optimal_interval(delta: float, mtbf: float) -> float:
    """Exact minimiser of :func:`expected_wall_time` (independent of ``restart``).

    With ``x = tau / M`` and ``d = delta / M`` the optimum solves ``(1 - x) e^(x + d) = 1``,
    whose left side falls strictly on ``(0, 1)``: bisection converges.
    """
    _check(delta, mtbf)
    if math.isinf(mtbf):
        return math.inf
    if delta == 0:
        return 0.0
    d = delta / mtbf
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if (1.0 - mid) * math.exp(mid + d) > 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi) * mtbf
