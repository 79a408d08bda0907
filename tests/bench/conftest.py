"""bench/ is not a package: its scripts import their siblings (``_harness``) by the
script's folder, so the tests put bench/ on the path and import them by name. The
harness's etcd version is asked of the etcd binary (a process): the unit tests read a
fixed one instead."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    import _harness

    monkeypatch.setattr(_harness, "_etcd_version", lambda: "3.5-test")
    return _harness
