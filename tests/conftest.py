"""Shared fixtures: unique shared-memory namespaces, cleaned up after each test."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_namespace() -> Iterator[str]:
    ns = f"test-{uuid.uuid4().hex[:10]}"
    yield ns
    shutil.rmtree(Path("/dev/shm") / f"stalwart-{ns}", ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _no_default_group_leaks() -> Iterator[None]:
    """A test module that initialised torch.distributed's default group in this process
    ends it with the module (its tests may share one): ``stalwart.init()`` refuses a
    process where one already exists (a script that called ``init_process_group`` first),
    so a leaked one would fail every later runtime test."""
    yield
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
