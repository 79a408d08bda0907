"""Elastic pieces that need no launcher: the join point, the admission protocol's state
transfer (bit for bit), the launch flags."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from stalwart.agent import LaunchConfig
from stalwart.checkpoint import SnapshotConfig, Snapshotter
from stalwart.cli.run import _range
from stalwart.coordinator import MemoryStore
from stalwart.errors import ConfigError
from stalwart.runtime.elastic._joiners import JoinRequest, JoinWatcher, Keys, slot_digest
from stalwart.runtime.elastic._rejoin import join_point
from stalwart.transfer import SlotReceiver


def test_survivors_at_one_live_step_need_no_restore() -> None:
    infos = {
        0: {"live": 28, "steps": [20]},
        1: {"live": 28, "steps": [20]},
        2: {"live": None, "steps": [28]},  # a joiner holding the transferred step
    }
    assert join_point(infos, None) == (28, "live")


def test_failed_step_falls_back_to_the_newest_common_snapshot() -> None:
    infos = {0: {"live": None, "steps": [9, 18]}, 1: {"live": None, "steps": [9, 18]}}
    assert join_point(infos, None) == (18, "memory")
    # one survivor completed the step the others failed: it rolls back with them
    infos[1] = {"live": 19, "steps": [9, 18]}
    assert join_point(infos, None) == (18, "memory")
    # a joiner that does not hold the live step forces the snapshot route
    infos = {0: {"live": 30, "steps": [27]}, 1: {"live": None, "steps": [27]}}
    assert join_point(infos, None) == (27, "memory")


def test_joiners_copy_the_survivors_step_when_none_is_common() -> None:
    # a survivor failed the boundary step the others completed while a joiner came in
    infos = {
        0: {"live": 28, "steps": [24, 28], "done": 28, "replicated": True},
        1: {"live": 27, "steps": [18, 24], "done": 27, "replicated": True},
        2: {"live": None, "steps": [26, 28], "done": 0, "replicated": True},  # joiner
    }
    assert join_point(infos, None) == (24, "peer")


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:8]
    pair = (f"test-el-src-{tag}", f"test-el-dst-{tag}")
    yield pair
    for ns in pair:
        shutil.rmtree(f"/dev/shm/stalwart-{ns}", ignore_errors=True)


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def test_joiner_receives_the_survivors_state_bit_for_bit(namespaces: tuple[str, str]) -> None:
    src_ns, dst_ns = namespaces
    token = b"t" * 32
    store = MemoryStore()
    keys = Keys("job")
    survivor = Snapshotter(SnapshotConfig(src_ns))
    joiner = Snapshotter(SnapshotConfig(dst_ns))
    state = _state(0)
    survivor.snapshot(state, 7)
    store.put(keys.member(keys.alive, 3), b"inc1")
    watcher = JoinWatcher(store, keys, token, survivor.directory, poll_s=0.01)
    try:
        with SlotReceiver(token) as rx:
            host, port = rx.start()
            req = JoinRequest(3, "inc1", host, port, dst_ns)
            store.put(keys.member(keys.join, 3), req.encode())
            deadline = time.monotonic() + 30
            while not watcher.has_ready() and time.monotonic() < deadline:
                time.sleep(0.01)  # the prefetch runs while the survivor "trains"
            assert watcher.take_ready() == [req]
            survivor.snapshot(state, 8)  # the step boundary: the current step, sent again
            watcher.send(req)
            got = rx.wait_results(2, 10)
        assert [r.step for r in got] == [7, 8] and all(r.ok for r in got)
        joiner.reload()
        assert joiner.steps() == [7, 8]
        found = [(i, m) for i in range(2) if (m := survivor._slots[i].read_meta())]
        src_slot = next(i for i, m in found if m.step == 8)
        assert slot_digest(survivor.directory, src_slot) == slot_digest(
            joiner.directory, got[-1].slot or 0
        )
        fresh = _state(1)
        joiner.restore(fresh, step=8)
        for a, b in zip(
            state["model"].state_dict().values(),  # type: ignore[attr-defined]
            fresh["model"].state_dict().values(),  # type: ignore[attr-defined]
            strict=True,
        ):
            assert torch.equal(a, b)
        # the joiner's next snapshot numbers itself after the received one
        joiner.snapshot(fresh, 9)
        assert joiner.latest() is not None and joiner.latest().step == 9  # type: ignore[union-attr]
    finally:
        watcher.close()
        survivor.close(unlink=True)
        joiner.close(unlink=True)


def test_launch_ranges(tmp_path: object) -> None:
    assert _range("2:4", "--nnodes") == (2, 4)
    assert _range("3", "--nnodes") == (None, 3)
    for bad in ("2:", ":4", "a", "2:4:6"):
        with pytest.raises(ConfigError, match="MIN:MAX"):
            _range(bad, "--nnodes")
    script = __file__
    cfg = LaunchConfig(script, nnodes=1, nproc_per_node=4, min_nproc_per_node=2, strategy="elastic")
    assert (cfg.world_size, cfg.min_world) == (4, 2)
    # other strategies accept torchrun's range and keep the world size at MAX
    assert LaunchConfig(script, nproc_per_node=4, min_nproc_per_node=2).min_world == 4
    with pytest.raises(ConfigError, match="1 <= MIN <= MAX"):
        LaunchConfig(script, nproc_per_node=2, min_nproc_per_node=3, strategy="elastic")


def test_live_rollback_undoes_what_a_failed_step_moved() -> None:
    from torch.utils.data import TensorDataset

    from stalwart.checkpoint import RNGState
    from stalwart.data import loader
    from stalwart.runtime.elastic._live import LiveRollback

    model = torch.nn.BatchNorm1d(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = loader(TensorDataset(torch.arange(40)), 4, world_size=1, rank=0)
    state = {"model": model, "opt": opt, "sched": sched, "loader": data, "_rng": RNGState()}
    live = LiveRollback(state)
    assert live.capable
    next(data)
    before = (data.state_dict(), model.running_mean.clone(), torch.get_rng_state())
    live.capture(1)
    model(torch.randn(8, 4))  # the failed step: buffers, RNG, loader move
    next(data)
    sched.step()  # the failed step's scheduler step: undone with the rest
    assert opt.param_groups[0]["lr"] == 0.05
    assert not live.rollback(0)  # not the step that was captured
    assert live.rollback(1)
    assert data.state_dict() == before[0]
    assert torch.equal(model.running_mean, before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert opt.param_groups[0]["lr"] == 0.1
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_live_rollback_refuses_state_it_cannot_vouch_for() -> None:
    from stalwart.runtime.elastic._live import LiveRollback

    live = LiveRollback({"big": torch.zeros(1 << 20)})
    assert not live.capable and "'big'" in live.reason
    live.capture(3)
    assert not live.rollback(3)
