"""A deterministic fault plan and the ledger that makes each fault fire once.

The plan is pure data: who fires a fault is decided by its trigger. Step-keyed rank
faults are fired by the worker itself at the start of that step, so the fault lands at
the same point of training in every run (what a bit-identical comparison needs);
time-keyed faults and node faults are fired by the node agent from its clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass

from stalwart.chaos.spec import ChaosSpecError, parse_spec

__all__ = ["Fault", "FaultLedger", "FaultPlan"]


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str  # kill | hang | slow | join | corrupt | nan
    text: str  # the spec fragment, for events
    rank: int | None = None
    node: int | None = None
    at_step: int | None = None
    at_time: float | None = None
    factor: float = 1.0
    duration: float | None = None  # seconds (slow, hang)
    steps: int | None = None  # slow: number of steps
    permanent: bool = False  # kill: the member is not started again (elastic)
    param: int | None = None  # corrupt: which replicated tensor (None: drawn)
    elem: int | None = None  # corrupt: which element of it (None: drawn)
    bit: int | None = None  # corrupt: which bit of the element (None: drawn)

    @property
    def domain(self) -> dict[str, int | None]:
        return {"rank": self.rank, "node": self.node}

    def slows(self, step: int, elapsed_since_fire: float) -> bool:
        """Is step ``step`` inside this (fired) slow fault's window?"""
        if self.kind != "slow":
            return False
        if self.steps is not None and self.at_step is not None:
            return step < self.at_step + self.steps
        return self.duration is None or elapsed_since_fire < self.duration


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> FaultPlan:
        if not spec:
            return cls()
        return cls(tuple(Fault(**rec) for rec in parse_spec(spec)))  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps([asdict(f) for f in self.faults])

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        return cls(tuple(Fault(**rec) for rec in json.loads(text)))

    def check_targets(self, *, world_size: int, nnodes: int) -> None:
        """Refuse a fault aimed outside the job (``rank=5`` of a 2-rank job, a node
        beyond ``--nnodes``): it could never fire. ``ChaosSpecError``, one line."""
        for f in self.faults:
            if f.rank is not None and f.rank >= world_size:
                raise ChaosSpecError(
                    f"chaos fault {f.text!r}: rank {f.rank} is outside the job (ranks "
                    f"0..{world_size - 1}); name a rank below {world_size}"
                )
            if f.node is not None and f.node >= nnodes:
                raise ChaosSpecError(
                    f"chaos fault {f.text!r}: node {f.node} is outside the job (nodes "
                    f"0..{nnodes - 1}, --nnodes {nnodes}); name a node below {nnodes}"
                )

    def home_faults(self, node: int, nproc_per_node: int) -> list[Fault]:
        """Faults aimed at ``node`` or at a rank it was launched with (the faults whose
        firing that node's agent answers for at the end of the run)."""
        return [
            f
            for f in self.faults
            if f.node == node or (f.rank is not None and f.rank // nproc_per_node == node)
        ]

    def worker_faults(self, rank: int, step: int) -> list[Fault]:
        """Faults the worker of ``rank`` fires itself when it begins ``step``."""
        return [f for f in self.faults if f.rank == rank and f.at_step == step and f.kind != "join"]

    def agent_faults(self, node: int, ranks: list[int]) -> list[Fault]:
        """Faults the agent of ``node`` (hosting ``ranks``) fires: time-keyed rank
        faults of its ranks, joins of its ranks, every fault on the node itself, and
        (node 0, which adopts the members of lost nodes) the joins of other nodes."""
        return [
            f
            for f in self.faults
            if f.node == node
            or (f.rank in ranks and (f.at_time is not None or f.kind == "join"))
            or (node == 0 and f.kind == "join")
        ]


class FaultLedger:
    """Fired faults, as files ``RUN_DIR/chaos/fired-<id>.json`` created with O_EXCL:
    exactly one process fires a fault, and the record (with its wall-clock time) is
    what detection latency is measured from."""

    def __init__(self, run_dir: str) -> None:
        self.directory = os.path.join(run_dir, "chaos")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)  # the run dir is private

    def _path(self, fault_id: int | str) -> str:
        return os.path.join(self.directory, f"fired-{fault_id}.json")

    def claim(self, fault: Fault, *, rank: int | None = None, pid: int | None = None) -> bool:
        """Record ``fault`` as fired now; False if it already was."""
        record: dict[str, object] = {
            "kind": fault.kind,
            "rank": rank,
            "pid": pid,
            "permanent": fault.permanent,
        }
        return self.claim_id(str(fault.id), record)

    def claim_id(self, key: str, record: dict[str, object]) -> bool:
        try:
            fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"t": time.time(), **record}, f)
        return True

    def fired(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                if name.startswith("fired-") and name.endswith(".json"):
                    with (
                        contextlib.suppress(OSError, ValueError),
                        open(os.path.join(self.directory, name)) as f,
                    ):
                        out[name[6:-5]] = json.load(f)
        return out

    def permanent(self, *, pid: int | None = None, node: int | None = None) -> bool:
        """Was the fault fired on process ``pid`` (or on ``node``) a permanent one?"""
        for rec in self.fired().values():
            mine = (pid is not None and rec.get("pid") == pid) or (
                node is not None and rec.get("node") == node
            )
            if mine and rec.get("permanent"):
                return True
        return False

    def fired_at(self, *, pid: int) -> float | None:
        """When the newest fault fired on process ``pid`` was (None if none was): a
        process slowed first and killed later was lost to the kill, and its detection
        latency counts from it (the records are listed in no particular order)."""
        times = [
            float(t)
            for rec in self.fired().values()
            if rec.get("pid") == pid and isinstance(t := rec.get("t"), (int, float))
        ]
        return max(times, default=None)
