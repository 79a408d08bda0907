"""``stalwart run``'s flags for silent data corruption and numerical faults, generated
from their worker contract fields (cli/_knob_flags.py; runtime/integrity/_checks.py reads them
from the contract; docs/detection.md)."""

from __future__ import annotations

import argparse

from stalwart.cli._knob_flags import knob_flag

__all__ = ["integrity_flags"]


def integrity_flags(p: argparse.ArgumentParser) -> None:
    """Silent data corruption and numerical faults (docs/detection.md)."""
    knob_flag(p, "sdc_every")
    knob_flag(p, "on_sdc")
    knob_flag(p, "on_nan")
    knob_flag(p, "spike_z")
    knob_flag(p, "spike_window")
