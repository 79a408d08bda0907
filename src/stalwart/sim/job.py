"""What the job costs: checkpoint stall and persistence, detection, and recovery per tier.

Every figure is seconds of wall time. The defaults are orders of magnitude for a large GPU job
(the presets in :mod:`stalwart.sim.presets` state their own); a calibration file measured on a
real run (:mod:`stalwart.sim.calibration`) replaces them.

Trade-offs
----------
* Time is continuous: the checkpoint interval is seconds of compute, not a number of steps. At the
  intervals that matter (minutes) a step (seconds) is a rounding error.
* ``restart`` checkpoints synchronously (``sync_save_s`` of stall, durable at once: what
  torch.save / DCP do); the other strategies take an in-memory snapshot (``snapshot_stall_s``) and
  persist it in the background (durable ``persist_s`` later, every ``persist_every`` snapshots).
* ``elastic`` throughput is proportional to the live nodes (constant global batch, DESIGN.md s.4);
  ``async`` pays ``async_penalty`` of its productive time as a convergence cost (LocalSGD /
  DiLoCo need more steps for the same loss). Both are stated parameters, not measured facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from stalwart.errors import ConfigError

__all__ = ["JobConfig", "RecoveryCosts"]


def _validate_seconds(obj: object, *, allow_none: tuple[str, ...] = ()) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if value is None and f.name in allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"{f.name} must be a finite number >= 0, got {value!r}; fix the flag or the "
                "calibration file that sets it"
            )


@dataclass(frozen=True)
class RecoveryCosts:
    """Fixed costs of detecting a fault and recovering from it, per strategy and tier."""

    detect_crash_s: float = 10.0
    detect_hang_s: float = 120.0
    detect_lease_s: float = 60.0
    restart_s: float = 300.0
    flash_restart_s: float = 30.0
    spare_takeover_s: float = 10.0
    reconfigure_s: float = 20.0
    node_replace_s: float = 900.0
    restore_memory_s: float = 2.0
    restore_peer_s: float = 10.0
    restore_disk_s: float = 30.0
    restore_remote_s: float = 120.0
    control_plane_s: float = 0.0
    """From a fault's detection until every survivor holds the new generation and the
    agreed restore step: every strategy's recovery waits for it. A scenario with a
    control-plane curve (:mod:`stalwart.sim.controlplane`) sets it for its node count."""

    def __post_init__(self) -> None:
        _validate_seconds(self)


@dataclass(frozen=True)
class JobConfig:
    """Checkpointing of the job and the parameters of the elastic and async strategies.

    ``interval_s`` is compute seconds between checkpoints; ``None`` picks Daly's optimum for each
    strategy's own stall and the cluster's MTBF.
    """

    interval_s: float | None = None
    snapshot_stall_s: float = 2.0
    sync_save_s: float = 60.0
    persist_s: float = 60.0
    persist_every: int = 1
    async_group_nodes: int = 64
    async_sync_interval_s: float = 600.0
    async_penalty: float = 0.05

    def __post_init__(self) -> None:
        _validate_seconds(self, allow_none=("interval_s",))
        if self.interval_s is not None and self.interval_s <= 0:
            raise ConfigError(
                f"checkpoint interval must be > 0 seconds, got {self.interval_s!r}; "
                "pass --interval-min > 0 or leave it out for Daly's optimum"
            )
        if self.persist_every < 1:
            raise ConfigError(f"persist_every must be >= 1, got {self.persist_every}")
        if self.async_group_nodes < 1:
            raise ConfigError(f"async group size must be >= 1 node, got {self.async_group_nodes}")
        if not 0 <= self.async_penalty < 1:
            raise ConfigError(
                f"async penalty must be in [0, 1), got {self.async_penalty!r}; "
                "it is the share of productive time lost to slower convergence"
            )
