"""Where snapshots may fall: at multiples of a unit of steps (a gradient accumulation cycle).

A loop that steps its optimizer every ``unit`` steps holds partial gradients no snapshot
tracks inside a cycle; a rollback there would redo the cycle from half of it. So a
snapshot or persist due inside a cycle is owed to the cycle's last step. Every member
owes the same ones (the cadence is the job's), so all snapshot alike.
"""

from __future__ import annotations

from stalwart.errors import ConfigError

__all__ = ["StepAlignment"]


class StepAlignment:
    """The one owner of the unit and of what is owed until the unit's end."""

    def __init__(self) -> None:
        self.unit = 1
        self._owed = (False, False)  # (persist, snapshot)

    def align(self, unit: int, check_every: int) -> None:
        """Snapshots only at multiples of ``unit`` (``check_every``: the integrity
        check's step interval, whose snapshot it compares, 0 when off)."""
        if unit < 1 or (self.unit > 1 and unit != self.unit):
            raise ConfigError(
                f"align_steps({unit}): steps are aligned to {self.unit} already, or the "
                "unit is < 1: align once, to the gradient accumulation cycle"
            )
        if check_every % unit:
            raise ConfigError(
                f"--sdc-every {check_every} is not a multiple of the gradient accumulation "
                f"cycle ({unit} steps), whose end is the only snapshot step: use "
                f"--sdc-every {unit * max(1, round(check_every / unit))}"
            )
        self.unit = unit

    def forgive(self) -> None:
        """After a recovery: what undone steps owed is owed no more."""
        self._owed = (False, False)

    def settle(self, step: int, final: bool, persist: bool, snapshot: bool) -> tuple[bool, bool]:
        """What to do after ``step``: (persist, snapshot), both False inside a unit (then
        owed to its end), what was owed added at the unit's end or the loop's last step."""
        persist, snapshot = persist or self._owed[0], snapshot or self._owed[1]
        if step % self.unit and not final:
            self._owed = (persist, snapshot)
            return False, False
        self._owed = (False, False)
        return persist, snapshot
