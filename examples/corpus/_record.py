"""What a corpus script leaves behind for tests/corpus/test_matrix.py to judge a run by.

Not part of any real script's style: the helper every corpus script records with, so that
each run writes the same two kinds of file under ``OUT`` (a folder in the run directory):

- ``trace-m<MEMBER>.jsonl``: one line per committed attempt of a step on that member
  (the rank it was launched with): ``step``, ``attempt`` (the torchrun restart count and
  the stalwart generation: a later attempt of the step supersedes an earlier one),
  ``rank``, ``world``, ``loss`` (this rank's), ``samples`` (what it read), ``t`` (the
  wall clock when the step was recorded: ``stalwart compare`` measures by it), any extras.
  A replacement process appends to the same file, so the file survives the process.
- ``final-m<MEMBER>.json``: written once at the end: the sha256 of the final parameters
  as this rank holds them (``digest``), the last step and the world size, and where the
  framework reports a summary after training (the Trainer's ``train_loss``,
  ``total_flos``), that (``summary``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import torch


def digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' bytes in key order: equal iff bit-identical."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Recorder:
    def __init__(self, out: str, member: int) -> None:
        os.makedirs(out, exist_ok=True)
        self.out, self.member = out, member
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._f = open(os.path.join(out, f"trace-m{member}.jsonl"), "a")  # noqa: SIM115

    def step(self, step: int, *, generation: int, rank: int, world: int, **fields: Any) -> None:
        rec = {"step": step, "attempt": [self.restart, generation], "rank": rank}
        rec["t"] = time.time()  # wall clock: `stalwart compare` times recoveries by it
        rec |= {"world": world, "member": self.member, "pid": os.getpid(), **fields}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def final(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        step: int,
        world: int,
        summary: Mapping[str, float] | None = None,
    ) -> None:
        rec: dict[str, Any] = {"member": self.member, "digest": digest(state), "step": step}
        rec["world"] = world
        if summary is not None:  # what the framework reported after training (train_loss)
            rec["summary"] = dict(summary)
        path = os.path.join(self.out, f"final-m{self.member}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)
        self._f.close()
