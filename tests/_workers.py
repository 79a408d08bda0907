"""How ``make test`` spreads the suite over pytest-xdist workers (``-n N --dist
loadgroup``) without two tests that share something running at once.

Most of a job test's wall time is waiting (a lease to lapse, a detection bound, a
worker importing torch), so a few jobs side by side nearly halve the e2e tier's wall
time. What runs where (``group_for_workers``, when xdist is in use):

- **e2e tests run a module at a time** (an ``xdist_group`` per test file): a module's
  fixtures (a Slurm cluster, an etcd server, a fault-free reference) are built once, on
  one worker, and its jobs never race each other for what the module sets up.
- **The corpus matrix runs a script at a time** (tests/corpus/test_matrix.py marks each
  cell ``corpus-<script>``): it is the largest module, and the cells of one script share
  their fault-free references (one session fixture per worker computes each once).
- **tests/hosts is one group**: its labs put nftables rules on the host's bridge family.
- **Unit tests are not grouped**: each runs wherever a worker is free. xdist hands out
  the groups with the most tests first (its ``loadscopereorder``), so no long group
  starts last and runs alone at the end.

Concurrent tests share nothing else by construction: every job has a fresh ``--rdzv-id``
(its /dev/shm names and run directory follow from it) under the test's own ``tmp_path``,
ports are free ports, and every wait scales with the load (tests/_load.py), which two
workers raise.
"""

from __future__ import annotations

import pytest

__all__ = ["group_for_workers"]


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs["name"])
    if item.get_closest_marker("e2e") is None:
        return None
    path = item.nodeid.split("::", 1)[0]
    return "hosts" if path.startswith("tests/hosts/") else path


def group_for_workers(items: list[pytest.Item]) -> None:
    """Mark every e2e item with its ``xdist_group`` (a corpus cell has its own)."""
    for item in items:
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
