"""The integrity checks' events (runtime/_integrity.py decides; this writes what it
decided): ``sdc_check`` for a check every replica passed, ``sdc_detected`` and each
suspect's ``fault_detected``, ``numeric_fault``, an evicted rank's ``isolation``, and a
rollback's ``restore`` and ``note``. docs/events.md documents them.

Why a passed check is written too (rank 0, one event every ``--sdc-every`` steps): a
report that shows no detection must also show that the checks ran (how many, up to which
step), and the digest of a passed check is what proves a flip harmless: equal to the
fault-free run's digest of the same step, the state is bit-identical to it there
(tests/runtime/test_sdc_run.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.metrics.events import EventLog
    from stalwart.runtime._formation import Position

__all__ = ["IntegrityEvents", "hex_digest"]


def hex_digest(digest: int) -> str:
    """A signed 64-bit digest (as it travels in an int64 tensor) in 16 hex digits."""
    return f"{digest & ((1 << 64) - 1):016x}"


class IntegrityEvents:
    """Writes the integrity events of one rank (``events`` None: nothing is written)."""

    def __init__(self, events: EventLog | None, position: Position, node: int) -> None:
        self.events, self.position, self.node = events, position, node

    @property
    def _leader(self) -> bool:
        return self.position.rank == 0

    def passed(self, step: int, digest: int) -> None:
        """Every replica's digest of check step ``step`` was ``digest``."""
        if self.events is not None and self._leader:
            world = self.position.world_size
            self.events.emit("sdc_check", step=step, digest=hex_digest(digest), replicas=world)

    def sdc(
        self,
        checked: int,
        step: int,
        digests: list[int],
        suspects: list[int],
        target: int | None,
        action: str,
        since: float,
    ) -> None:
        """The digests of check step ``checked`` differed (seen at the end of ``step``);
        ``since``: when the corruption happened at the earliest (for the latency)."""
        if self.events is None:
            return
        if self._leader:
            self.events.emit(
                "sdc_detected",
                step=checked,
                detected_step=step,
                ranks=suspects,
                digests=[hex_digest(d) for d in digests],
                verified_step=-1 if target is None else target,
                action=action,
            )
        if self.position.rank in suspects:
            self.events.emit(
                "fault_detected",
                fault="sdc",
                domain={"rank": self.position.rank, "node": self.node},
                latency_s=max(0.0, time.time() - since),
                how=f"replica digest of step {checked} differs from the majority's",
            )

    def numeric(self, step: int, reason: str, ranks: list[int], action: str, **fields: Any) -> None:
        """A logged value was non-finite or spiked at ``step``: ``report`` from the rank
        itself, the decisions every rank took alike (rollback, retry, verdict) from rank 0."""
        if self.events is not None and (action == "report" or self._leader):
            self.events.emit(
                "numeric_fault", step=step, reason=reason, ranks=ranks, action=action, **fields
            )

    def evicted(self) -> None:
        if self.events is not None:
            self.events.emit(
                "isolation",
                member=f"rank{self.position.rank}",
                reason="silent data corruption: its replica digest differed from the majority's",
                blocklisted=False,
            )

    def restored(self, target: int, seconds: float, why: str) -> None:
        if self.events is not None and self._leader:
            self.events.emit("restore", step=target, tier="memory", seconds=seconds)
            self.events.emit("note", message=f"integrity rollback to step {target} ({why})")
