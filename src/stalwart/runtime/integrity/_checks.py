"""Silent data corruption and numerical faults, found between steps (docs/detection.md).

**Replica digests.** A DDP job's replicas must be bit-identical after every step. Every
``sdc_every`` steps (K) the step's snapshot is forced, and once its copy is complete the
copying thread computes a digest of the replicated tensors (runtime/integrity/_digest.py: the
parameters and the optimizer state, xxh3-64), so the step loop does not wait for it. At
the end of the next step the ranks exchange their digests in one small allreduce. All
equal: that snapshot is *verified* and pinned (it stays in its slot until the next one is
verified; the job then keeps three slots, not two). A mismatch: the ranks that differ
from a strict majority are the fault domain (two replicas have no majority: both are
suspects), every rank rolls back to the verified snapshot in its own slots (it matched
the others when it was taken), discards newer snapshots, and goes on; with ``evict`` the
minority ranks then leave (SIGKILL, as a crash), and the job's strategy replaces them
(a spare, a flash restart) from that same verified step. Corruption that happened after
step S is found at the end of step S' + 1 for the first check step S' >= the corrupted
step: within K + 1 steps.

**Numerical faults.** Values given to ``sess.log(loss=...)`` (and ``grad_norm=``) are
judged per rank (runtime/integrity/_spikes.py). ``report``: a typed event. ``rollback``: the ranks
exchange their verdicts at the end of every step (the digests' allreduce); if any rank
flagged step S, all restore the newest snapshot before S, mark S skipped (the loop does
not yield it; tracked loaders draw and drop its batches: the data position advances) and
go on. With replica checks on, a first flag replays from the verified snapshot instead,
without a skip (a corrupted state spreads NaN to every replica within one step, before
the digests see it); the same position flagged again is skipped. One more flag there,
or three skips within a spike window, is a verdict (:class:`NumericalFaultError`).

Every rank takes the same decision from the same exchanged numbers, so no rank waits for
another's verdict and the group is never re-formed for an integrity rollback.

**Events** (:class:`IntegrityEvents`, docs/events.md): ``sdc_check`` for a check every
replica passed, ``sdc_detected`` and each suspect's ``fault_detected``,
``numeric_fault``, an evicted rank's ``isolation``, and a rollback's ``restore`` and
``note``. Why a passed check is written too (rank 0, one event every ``--sdc-every``
steps): a report that shows no detection must also show that the checks ran (how many,
up to which step), and the digest of a passed check is what proves a flip harmless:
equal to the fault-free run's digest of the same step, the state is bit-identical to it
there (tests/runtime/integrity/test_sdc_run.py).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from stalwart.errors import StalwartError
from stalwart.runtime.integrity._digest import (
    majority_split,
    replicated_tensors,
    state_digest,
    tamper,
)
from stalwart.runtime.integrity._spikes import Reading, SpikeWatch

if TYPE_CHECKING:
    from stalwart.chaos import Fault
    from stalwart.contract.env import WorkerEnv
    from stalwart.metrics.events import EventLog
    from stalwart.runtime.comm._formation import Position
    from stalwart.runtime.comm.group import GenerationGroup
    from stalwart.runtime.state._tracking import TrackedState

__all__ = ["Integrity", "IntegrityEvents", "NumericalFaultError", "Rollback", "hex_digest"]

_WATCHED = ("loss", "grad_norm")  # non-finite checks; spikes: loss only
_MAX_NUMERIC_ROLLBACKS = 3  # within one spike window: then a verdict
_HELD = 4  # snapshot steps a rank offers as rollback targets (it keeps 2 or 3 slots)


class NumericalFaultError(StalwartError):
    """A numerical fault came back where it was rolled back before."""


@dataclass(frozen=True)
class Rollback:
    """The session's part of a rollback the integrity checks made: the step the state
    is now at, and whether this rank then leaves (``evict``)."""

    step: int
    evict: bool = False


@dataclass
class _Check:
    step: int
    digest: int | None = None  # set on the copying thread once the copy is complete


@dataclass
class _Numeric:
    """This rank's view of the current step's logged values."""

    reading: Reading = Reading.OK
    value: float | None = None
    positions: dict[str, list[int]] = field(default_factory=dict)


class Integrity:
    """Owns the digest checks, the verified snapshot's pin and the numeric watch."""

    def __init__(
        self,
        env: WorkerEnv,
        tracked: TrackedState,
        group: GenerationGroup,
        position: Position,
        events: EventLog | None,
    ) -> None:
        self.env, self.tracked, self.group, self.position = env, tracked, group, position
        self.log = IntegrityEvents(events, position, env.node_rank)
        self.every = env.sdc_every
        self.evicts = env.on_sdc == "evict"
        self.sdc_rolls_back = env.on_sdc != "report"
        self.nan_rolls_back = env.on_nan == "rollback"
        self.watch = SpikeWatch(env.spike_z, env.spike_window)
        self._check: _Check | None = None
        self._verified: tuple[int, int] | None = None  # (step, pinned slot)
        self._verified_t = time.time()
        self._now = _Numeric()
        self._injected_t: float | None = None
        self._skipped: set[int] = set()
        self._flagged: dict[str, int] = {}  # data position -> numeric faults seen there
        self._rollbacks: deque[int] = deque(maxlen=_MAX_NUMERIC_ROLLBACKS)

    # ------------------------------------------------------------ the step loop's hooks
    @property
    def active(self) -> bool:
        return self.every > 0 and self.tracked.replicated

    def due(self, step: int) -> bool:
        """Is ``step`` a check step (its snapshot is forced)?"""
        return self.active and step % self.every == 0

    def observe(self, metrics: dict[str, Any]) -> None:
        """``sess.log``: judge the watched values (a tensor is read here, once)."""
        for name in _WATCHED:
            if name in metrics:
                raw = metrics[name]
                value = float(raw.detach() if isinstance(raw, torch.Tensor) else raw)
                if name == "loss":
                    reading = self.watch.judge(value)
                else:
                    reading = Reading.OK if math.isfinite(value) else Reading.NONFINITE
                if reading > self._now.reading:
                    self._now.reading, self._now.value = reading, value

    def begin(self, step: int) -> bool:
        """A step begins: False if it was skipped by a numeric rollback (its batch is
        drawn and dropped here; the loop does not yield it)."""
        from stalwart.data import Loader

        loaders = {k: v for k, v in self.tracked.state.items() if isinstance(v, Loader)}
        if step in self._skipped:
            for loader in loaders.values():
                for _ in loader.step_batches():
                    pass
            return False
        self._now = _Numeric(positions={k: [v.epoch, v.position] for k, v in loaders.items()})
        return True

    def snapshotted(self, step: int) -> None:
        """A snapshot of ``step`` was started: at a check step, digest it once copied."""
        if not self.due(step):
            return
        check = self._check = _Check(step)
        tensors = replicated_tensors(self.tracked.state)

        def digest(error: BaseException | None) -> None:
            if error is None:
                check.digest = state_digest(tensors)

        self.tracked.snapshots.after_copy(digest)

    def formed(self, step: int) -> None:
        """A (re)formation restored ``step``: a check in flight is void, and a verified
        snapshot newer than the state is no rollback target."""
        self._check = None
        self._now = _Numeric()
        if self._verified is not None and self._verified[0] > step:
            self._unpin()

    def after_step(self, step: int) -> Rollback | None:
        """The end of step ``step`` (before its snapshot): exchange, decide, roll back."""
        check, now = self._check, self._now
        self._check = None
        rank, world = self.position.rank, self.position.world_size
        if world > 1 and (check is not None or self.nan_rolls_back):
            exchanged = self._exchange(check, now.reading)
            if exchanged is None:
                return None  # the exchange failed: the next step fails and recovers
            digests, flags = exchanged
        else:
            digests, flags = None, [int(now.reading) if r == rank else 0 for r in range(world)]
        if check is not None and digests is not None:
            back = self._judge_digests(check.step, step, digests)
            if back is not None:
                return back
        if any(flags):
            return self._numeric(step, now, flags)
        return None

    def _exchange(
        self, check: _Check | None, reading: Reading
    ) -> tuple[list[int] | None, list[int]] | None:
        """One allreduce of every rank's digest (at a check) and numeric reading."""
        world, rank = self.position.world_size, self.position.rank
        if check is not None:
            self.tracked.snapshots.wait()  # the copying thread has set the digest
        flat = torch.zeros(2 * world, dtype=torch.int64)
        if check is not None and check.digest is not None:
            flat[rank] = check.digest
        if self.nan_rolls_back:
            flat[world + rank] = int(reading)
        self.group.allreduce_(flat)
        if self.group.error is not None:
            return None
        values = flat.tolist()
        return (values[:world] if check is not None else None), values[world:]

    # ------------------------------------------------------------ replica digests
    def _judge_digests(self, checked: int, step: int, digests: list[int]) -> Rollback | None:
        majority, suspects = majority_split(digests)
        if not suspects:
            self._verify(checked)
            self.log.passed(checked, digests[0])
            return None
        verified = self._verified[0] if self._verified is not None else -1
        target = None
        if self.sdc_rolls_back:  # on every rank: the digests are the same everywhere
            common = self._common_steps(lambda s: s <= verified)
            if common is None:
                return None  # the exchange failed: the next step fails and recovers
            target = common[-1] if common else None
        mine = self.position.rank in suspects
        if not self.sdc_rolls_back:
            action = "report"
        elif target is None:
            action = "report: no verified snapshot yet"
        else:
            action = "rollback + evict" if self.evicts else "rollback"
        since = self._injected_t if self._injected_t is not None else self._verified_t
        self.log.sdc(checked, step, digests, suspects, target, action, since)
        if target is None:
            return None
        self._restore(target, f"sdc: replica digests differ at step {checked}")
        return Rollback(target, evict=self.evicts and mine and majority is not None)

    def _verify(self, step: int) -> None:
        """Pin the slot of ``step`` (the newest complete one now) as the rollback target."""
        found = self.tracked.snapshots.pin_latest(wait=False)
        if found is None:
            return
        if found[1].step != step:
            self.tracked.snapshots.unpin(found[0])
            return
        self._unpin()
        self._verified = (step, found[0])
        self._verified_t = time.time()

    def _unpin(self) -> None:
        if self._verified is not None:
            self.tracked.snapshots.unpin(self._verified[1])
            self._verified = None

    def evict(self) -> None:
        """This rank is the corrupt minority and the policy is ``evict``: leave as a
        crash does, so that the strategy replaces it from the verified step."""
        self.log.evicted()
        os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------ numerical faults
    def _numeric(self, step: int, now: _Numeric, flags: list[int]) -> Rollback | None:
        ranks, reading = [r for r, f in enumerate(flags) if f], Reading(max(flags))
        keys = {f"step:{step}", *(f"{n}:{e}:{p}" for n, (e, p) in now.positions.items())}
        seen = max((self._flagged.get(k, 0) for k in keys), default=0)
        for k in keys:
            self._flagged[k] = seen + 1
        if not self.nan_rolls_back:
            self._report_numeric(step, now, ranks, reading, "report", -1)
            return None
        # with replica checks on, the first flag may be a corrupted state the digests had
        # no time to see (its NaN reaches every replica in one step): replay from the
        # verified snapshot first; the same position flagged again is the data: skip it
        retry = self.active and seen == 0
        verified = self._verified[0] if self._verified is not None else -1
        older = self._common_steps((lambda s: s <= verified) if retry else (lambda s: s < step))
        if older is None:
            return None  # the exchange failed: the next step fails and recovers
        if not retry:
            self._rollbacks.append(step)
        window = self.env.spike_window
        burst = len(self._rollbacks) == _MAX_NUMERIC_ROLLBACKS and (
            self._rollbacks[-1] - self._rollbacks[0] <= window
        )
        if seen > int(self.active) or burst or not older:
            self._report_numeric(step, now, ranks, reading, "verdict", -1)
            why = "again at the same data position" if seen else "with no snapshot before it"
            why = f"{_MAX_NUMERIC_ROLLBACKS} times within {window} steps" if burst else why
            where = f"step {step}" + "".join(
                f", {name} at epoch {e} position {p}" for name, (e, p) in now.positions.items()
            )
            raise NumericalFaultError(
                f"the logged loss was {reading.name.lower()} at {where} {why}: replaying "
                "cannot get past it; inspect that batch and the model's numerics (or run "
                "with --on-nan report to train on)"
            )
        if not retry:
            self._skipped.add(step)
        self._restore(older[-1], f"numeric: {reading.name.lower()} loss at step {step}")
        self._report_numeric(step, now, ranks, reading, "retry" if retry else "rollback", older[-1])
        return Rollback(older[-1])

    def _report_numeric(
        self, step: int, now: _Numeric, ranks: list[int], reading: Reading, action: str, to: int
    ) -> None:
        value = now.value if now.value is not None and reading == Reading.SPIKE else None
        extra: dict[str, Any] = {} if value is None else {"value": value, "z": self.watch.last_z}
        self.log.numeric(
            step,
            reading.name.lower(),
            ranks,
            action,
            restored_step=to,
            skipped_step=step if action == "rollback" else -1,
            data_position={"step": step, **{k: list(v) for k, v in now.positions.items()}},
            **extra,
        )

    # ------------------------------------------------------------ both
    def _common_steps(self, eligible: Callable[[int], bool]) -> list[int] | None:
        """The snapshot steps every rank holds, among those ``eligible``, oldest first
        (None: the exchange failed). Ranks hold different steps (a rank snapshots every
        step until it reads the cadence rank 0 chose), so a rollback target is agreed in
        one more small allreduce, made only when every rank decided to roll back."""
        mine = [s for s in self.tracked.snapshots.steps() if eligible(s)][-_HELD:]
        world, rank = self.position.world_size, self.position.rank
        if world == 1:
            return mine
        flat = torch.zeros(world * _HELD, dtype=torch.int64)
        for i, s in enumerate(mine):
            flat[rank * _HELD + i] = s + 1  # 0: no step
        self.group.allreduce_(flat)
        if self.group.error is not None:
            return None
        held = [{v - 1 for v in row if v > 0} for row in flat.view(world, _HELD).tolist()]
        return sorted(set.intersection(*held))

    def _restore(self, target: int, why: str) -> None:
        t0 = time.perf_counter()
        snaps = self.tracked.snapshots
        snaps.restore(self.tracked.state, step=target)
        snaps.discard_newer(target)
        self._check = None
        self.log.restored(target, time.perf_counter() - t0, why)

    def inject(self, fault: Fault, step: int) -> str:
        """Chaos ``corrupt`` / ``nan`` on this rank's live state, once the snapshot in
        flight is complete (the fault lands in the state, not in the copy)."""
        if self.tracked.opened:
            self.tracked.snapshots.wait()
        self._injected_t = time.time()
        return tamper(self.tracked.state, fault, step)


# ------------------------------------------------------------ the events


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
