"""How ``make test TEST_WORKERS=N`` spreads the suite over pytest-xdist workers (``-n N
--dist loadgroup``) without two tests that share something running at once.

A job test waits part of its wall time (a lease to lapse, a detection bound, a hung
rank's deadline), time another worker's tests can use on a machine with cores to spare;
on 2 cores the jobs are CPU-bound and each worker collects the suite again, so the
Makefile's default is one process. What runs where (``group_for_workers``, when xdist
is in use):

- **A test file runs on one worker** (an ``xdist_group`` per file, what ``--dist
  loadfile`` does): a module's fixtures (a Slurm cluster, an etcd server, a fault-free
  reference) are built once, its jobs never race each other for what the module sets
  up, and tests that share module state (a default process group) stay together.
- **The corpus matrix runs a script at a time** (tests/corpus/test_matrix.py marks each
  cell ``corpus-<script>``): it is the largest module, and the cells of one script share
  their fault-free references (one session fixture per worker computes each once).
- **A multi-host test is a group of its own** (tests/hosts): it waits most of its wall
  time (a partition, a lease, TCP's backoff after a heal), and its lab shares nothing with
  another lab: its own bridge, namespaces and nftables table, whose rules match only
  packets that enter the lab's own bridge ports (tests/hosts/_lab.py).

xdist hands out the groups with the most tests first (its ``loadscopereorder``), so no
long group starts last and runs alone at the end.

Concurrent tests share nothing else by construction: every job has a fresh ``--rdzv-id``
(its /dev/shm names and run directory follow from it) under the test's own ``tmp_path``,
ports are free ports, and every wait scales with the load (tests/_load.py), which the other
workers raise.
"""

from __future__ import annotations

import pytest

__all__ = ["group_for_workers"]


def _group(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    return item.nodeid if path.startswith("tests/hosts/") else path


def group_for_workers(items: list[pytest.Item]) -> None:
    """Mark every item with its ``xdist_group`` (a corpus cell has its own)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
