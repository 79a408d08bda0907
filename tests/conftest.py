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
