"""Fixtures of the multi-host tests: a lab of network namespaces (``_lab.py``), removed
with everything in it even when a test fails, and jobs whose agents are all reaped.

Where the machine cannot build a lab (not root, no ``ip``/``nft``), the tests skip with
the reason, and fail instead under ``CI`` (``.ci/run`` installs iproute2 and nftables
and runs as root), as the etcd, Slurm and browser tests do: the multi-host cells can
never silently go unrun in CI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ._flash import fault_free_digests
from ._job import HostJob
from ._lab import Lab, lab_missing


def require_lab() -> None:
    why = lab_missing()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the multi-host tests: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The digests of the flash cells' job run fault-free on one host (``_flash.py``),
    once for every file of cells."""
    require_lab()
    return fault_free_digests(tmp_path_factory.mktemp("ref"))


@pytest.fixture
def lab_factory() -> Iterator[Callable[..., Lab]]:
    """``lab_factory(n)``: a started lab of ``n`` hosts, closed after the test."""
    require_lab()
    labs: list[Lab] = []

    def make(n: int, **kw: object) -> Lab:
        lab = Lab(n, **kw)  # type: ignore[arg-type]
        labs.append(lab)
        lab.start()
        return lab

    yield make
    problems = []
    for lab in reversed(labs):
        try:
            lab.close()
        except RuntimeError as err:
            problems.append(str(err))
    assert not problems, problems


@pytest.fixture
def jobs(lab_factory: Callable[..., Lab]) -> Iterator[Callable[..., HostJob]]:
    """``jobs(lab, work, hosts, script_args, ...)``: a started :class:`HostJob`; every
    agent still running at the test's end is stopped before the lab is removed."""
    started: list[HostJob] = []

    def make(lab: Lab, work: Path, hosts: list[int], args: list[str], **kw: object) -> HostJob:
        job = HostJob(lab, work, hosts, args, **kw)  # type: ignore[arg-type]
        started.append(job)
        return job.start()

    yield make
    for job in started:
        job.stop()
