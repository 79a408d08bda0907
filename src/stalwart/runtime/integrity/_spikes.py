"""Non-finite values and loss spikes in what a script gives ``sess.log``.

A value is judged against this rank's own running window (each rank trains on its own
batches, so its losses are its own): non-finite (NaN, inf) always; a spike when its
z-score over the window's finite values exceeds ``z`` once the window holds enough of
them to have a spread (``min_values``). Only upward spikes count: a loss that drops
fast is training. A flagged value never enters the window, so one spike does not widen
the spread that the next one is judged by.
"""

from __future__ import annotations

import enum
import math
from collections import deque

__all__ = ["Reading", "SpikeWatch"]


class Reading(enum.IntEnum):
    """What a step's value was; travels as an integer in the integrity exchange."""

    OK = 0
    NONFINITE = 1
    SPIKE = 2


class SpikeWatch:
    def __init__(self, z: float, window: int, min_values: int = 20) -> None:
        self.z = z  # 0: spikes are not judged (non-finite values still are)
        self.min_values = min(min_values, window)
        self._values: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._sq = 0.0
        self.last_z = 0.0  # the z-score of the last value judged (for the event)

    def judge(self, value: float) -> Reading:
        """Classify ``value``; a finite, unflagged one joins the window."""
        if not math.isfinite(value):
            self.last_z = 0.0
            return Reading.NONFINITE
        n = len(self._values)
        if self.z > 0 and n >= self.min_values:
            mean = self._sum / n
            var = max(self._sq / n - mean * mean, 0.0)
            std = math.sqrt(var)
            # a flat window (std ~ 0) judges nothing: any change would be infinite sigma
            self.last_z = (value - mean) / std if std > 1e-12 * max(1.0, abs(mean)) else 0.0
            if self.last_z > self.z:
                return Reading.SPIKE
        self._push(value)
        return Reading.OK

    def _push(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            old = self._values[0]
            self._sum -= old
            self._sq -= old * old
        self._values.append(value)
        self._sum += value
        self._sq += value * value
