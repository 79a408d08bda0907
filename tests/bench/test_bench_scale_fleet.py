"""bench/_scale_fleet.py: the emulated nodes over processes. The slices cover every node
once, each node has its own loopback address, and a small fleet over two processes forms
against a real embedded store, agrees again after losing a node, and leaves no process."""

from __future__ import annotations

import pytest


def test_slices_cover_every_node_once() -> None:
    from _scale_fleet import slices

    for n, procs in ((16, 1), (1024, 8), (10, 3), (3, 8)):
        parts = slices(n, procs)
        assert len(parts) == min(n, procs)
        assert [i for lo, hi in parts for i in range(lo, hi)] == list(range(n))


def test_every_node_has_its_own_loopback_address() -> None:
    from _scale_fleet import loopback

    addrs = [loopback(i) for i in range(70_000)]
    assert len(set(addrs)) == len(addrs)
    assert all(a.startswith("127.") and not a.endswith(".0") for a in addrs)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_fleet_of_two_processes_forms_and_agrees_after_a_loss() -> None:
    from _scale_backends import start_embedded
    from _scale_fleet import Fleet

    backend, token = start_embedded(max_connections=128)
    cfg = {
        "lease_s": 3.0,
        "poll_s": 0.1,
        "step_s": 0.2,
        "agree_timeout_s": 120.0,
        "scan": "view",
        "verdict_s": 1.0,
        "feed": True,
    }
    config = {
        "backend": "embedded",
        "address": backend.address,
        "token": token.hex(),
        "lease_s": 3.0,
        "cfg": cfg,
    }
    fleet = None
    try:
        fleet = Fleet(4, 2, config)
        t0 = fleet.start()
        joined = fleet.wait_agreed(0, "formation", 120)
        assert len(joined) == 4 and joined[0] >= t0
        t_loss = fleet.lose(3, 0, peer=True)  # node 3 lives in the second process
        agreed = fleet.wait_agreed(1, "agreement after the loss", 120)
        assert len(agreed) == 3 and agreed[0] >= t_loss
    finally:
        if fleet is not None:
            fleet.close()
        backend.stop()
    assert fleet is not None
    assert all(child.proc.poll() is not None for child in fleet.children)
