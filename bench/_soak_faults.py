"""bench/soak.py's parts that need no running job: the faults it draws, what it records
of each, and rank 0's step log read as it grows."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FAILS",
    "KINDS",
    "FailureBudget",
    "Fault",
    "FaultResult",
    "StepLog",
    "draw_faults",
    "parse_weights",
]

KINDS = ("kill", "hang", "slow", "node_loss")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None  # rank faults
    factor: float | None = None  # slow
    seconds: float | None = None  # slow

    def spec(self) -> str:
        """The chaos spec of a rank fault (docs/recovery.md "Chaos")."""
        if self.kind == "slow":
            return f"slow rank={self.rank} factor={self.factor:g} for={self.seconds:g}s"
        return f"{self.kind} rank={self.rank}"

    def target(self) -> str:
        if self.kind == "node_loss":
            return "node 1"
        if self.kind == "slow":
            return f"rank {self.rank} x{self.factor:g} {self.seconds:g}s"
        return f"rank {self.rank}"


def parse_weights(text: str) -> dict[str, float]:
    """``kill=4,hang=3,slow=3,node_loss=1`` -> weights (kinds left out weigh 0)."""
    out = dict.fromkeys(KINDS, 0.0)
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        if kind not in out:
            raise ValueError(f"--weights: unknown fault {kind!r}; use {', '.join(KINDS)}")
        out[kind] = float(value)
    if not any(w > 0 for w in out.values()):
        raise ValueError("--weights: give at least one fault a weight above 0")
    return out


def _one(rng: random.Random, kind: str, ranks: list[int]) -> Fault:
    if kind == "node_loss":
        return Fault(kind)
    rank = rng.choice(ranks)
    if kind == "slow":
        return Fault(kind, rank, round(rng.uniform(2.0, 6.0), 1), float(rng.randint(3, 10)))
    return Fault(kind, rank)


def draw_faults(
    rng: random.Random, world: int, weights: dict[str, float], budget: FailureBudget
) -> Iterator[Fault]:
    """Every kind with a weight once, in a drawn order, then kinds drawn by weight. A
    kill or hang goes to a rank the isolation budget still allows; when it allows none,
    the fault is drawn again among the others (slow and node loss fail no rank)."""
    kinds = [k for k in KINDS if weights[k] > 0]
    rng.shuffle(kinds)
    while True:
        kind = kinds.pop(0) if kinds else rng.choices(KINDS, [weights[k] for k in KINDS])[0]
        ranks = list(range(world))
        if kind in FAILS:
            ranks = [r for r in ranks if budget.allows(r)]
            if not ranks:
                rest = [k for k in KINDS if k not in FAILS]
                kind = (
                    rng.choices(rest, [weights[k] for k in rest])[0]
                    if any(weights[k] > 0 for k in rest)
                    else "slow"
                )
                ranks = list(range(world))
        yield _one(rng, kind, ranks)


FAILS = ("kill", "hang")  # the faults that count as a worker failure


class FailureBudget:
    """What the job's isolation lets through: a rank, and a node other than 0, that
    fails ``threshold`` times within ``window`` seconds is blocklisted and the job ends
    (docs/recovery.md, "Isolation"). The failures are the job's own ``fault_detected``
    records of crashes and hangs (a peer the agent killed because it waited in a
    collective of a generation the job left is collateral: it has no such record and
    the job does not count it). A kill or hang is allowed only while every rank and
    node 1 is at most ``threshold - 2``: a margin of one failure for what the job may
    count that the soak did not see yet."""

    def __init__(self, threshold: int, window: float, nproc: int, world: int) -> None:
        self.threshold, self.window, self.nproc, self.world = threshold, window, nproc, world
        self.failures: list[tuple[int, float]] = []  # (rank, when), from the events

    def update(self, events: list[dict[str, Any]]) -> None:
        """The failures recorded in the current run's events (a relaunch starts a new
        store, so a new count)."""
        self.failures = [
            (int(e["domain"]["rank"]), float(e["t"]))
            for e in events
            if e.get("kind") == "fault_detected"
            and e.get("fault") in ("crash", "hang")
            and isinstance(e.get("domain"), dict)
            and isinstance(e["domain"].get("rank"), int)
        ]

    def allows(self, rank: int, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        recent = [r for r, t in self.failures if now - t < self.window]
        most = self.threshold - 2
        per_rank = max((recent.count(r) for r in range(self.world)), default=0)
        node1 = sum(1 for r in recent if r // self.nproc != 0)
        return per_rank <= most and node1 <= most


@dataclass
class FaultResult:
    """What became of one fault: ``recovered_s`` from the fault to the end of the first
    step rank 0 completed after it in a later generation (for ``slow``: after the slow
    period); ``redone`` the steps completed before the fault that were done again."""

    t: float  # since the soak's start
    fault: Fault
    step_before: int
    gen_before: int
    survived: bool = False
    recovered_s: float | None = None
    redone: int = 0
    detected_s: float | None = None
    back_s: float | None = None  # node_loss: the relaunched job's first step
    back_redone: int = 0
    resumed_at: int = 0  # node_loss: the checkpoint step the relaunched job resumed from
    note: str = ""

    def recovered(self, seconds: float, first_step: int) -> None:
        self.survived, self.recovered_s = True, seconds
        self.redone = max(0, self.step_before - first_step + 1)

    def line(self) -> str:
        head = f"{self.fault.kind:<9} {self.fault.target():<18}"
        if not self.survived and self.recovered_s is None:
            return f"{head} NOT RECOVERED: {self.note}"
        det = "" if self.detected_s is None else f" (detected in {self.detected_s:.2f} s)"
        if self.fault.kind == "slow":
            return (
                f"{head} went through: {self.note}; next step {self.recovered_s:.2f} s after "
                f"it{det}, {self.redone} steps redone"
            )
        text = f"{head} recovered in {self.recovered_s:.2f} s{det}, {self.redone} steps redone"
        if self.fault.kind == "node_loss":
            if self.back_s is None:
                text += f"; node 1 NOT BACK: {self.note}"
            else:
                text += f"; node 1 back in {self.back_s:.1f} s (both agents relaunched, resumed "
                text += f"from checkpoint step {self.resumed_at}, {self.back_redone} steps redone)"
        elif self.note:
            text += f"; {self.note}"
        return text

    def as_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 1),
            "fault": self.fault.kind,
            "target": self.fault.target(),
            "survived": self.survived,
            "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 3),
            "detected_s": None if self.detected_s is None else round(self.detected_s, 3),
            "redone": self.redone + self.back_redone,
            "back_s": None if self.back_s is None else round(self.back_s, 2),
            "note": self.note,
        }


class StepLog:
    """Rank 0's ``{step, t, gen}`` lines, read incrementally (a torn last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._entries: list[dict[str, Any]] = []

    def entries(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                try:
                    self._entries.append(json.loads(line))
                except ValueError:
                    continue  # a line torn by a kill, completed by nobody
            self._offset += end
        return self._entries

    def last(self) -> dict[str, Any] | None:
        entries = self.entries()
        return entries[-1] if entries else None

    def first_after(
        self, t: float, where: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any] | None:
        entries = self.entries()
        i = len(entries)
        while i > 0 and entries[i - 1]["t"] > t:
            i -= 1
        return next((e for e in entries[i:] if where(e)), None)

    def redone(self) -> int:
        """Completions minus distinct steps: every step done more than once."""
        entries = self.entries()
        return len(entries) - len({e["step"] for e in entries})

    def wait_steps(self, n: int, alive: Callable[[], bool], timeout: float) -> bool:
        """Until ``n`` steps are logged (False: the job died or ``timeout`` passed)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive():
            if len(self.entries()) >= n:
                return True
            time.sleep(0.1)
        return False
