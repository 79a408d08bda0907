"""The agent-worker contract: what `stalwart run`'s agent and its workers agree on.

Four things cross the line between the agent (which never imports torch) and the
worker runtime, and they live here so that neither side owns them:

- :mod:`stalwart.contract.env`: the worker environment (:class:`WorkerEnv`), every
  field's type, bounds and default, and its wire form (docs/worker-contract.md);
- :mod:`stalwart.contract.strategy`: the recovery strategy (:class:`Strategy`);
- :mod:`stalwart.contract.board`: the progress board's layout in shared memory
  (docs/recovery.md, "The progress board");
- :mod:`stalwart.contract.shm_names`: every /dev/shm name of a job
  (:class:`SlotNames`; docs/checkpoint-format.md).

This package imports neither ``stalwart.agent`` nor ``stalwart.runtime`` nor torch
(tests/test_structure.py checks it): both sides import it.
"""

from __future__ import annotations

from stalwart.contract.board import ProgressBoard, Slot
from stalwart.contract.env import DEFAULTS, WorkerEnv
from stalwart.contract.shm_names import SlotNames
from stalwart.contract.strategy import STRATEGIES, Strategy

__all__ = ["DEFAULTS", "STRATEGIES", "ProgressBoard", "Slot", "SlotNames", "Strategy", "WorkerEnv"]
