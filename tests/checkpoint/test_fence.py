"""The on-disk fence: a member stopped between its generation check and its manifest
write cannot make its step visible once a newer generation has moved on."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from stalwart.checkpoint import committed_steps, publish_step, verify_step
from stalwart.checkpoint._writer import write_rank
from stalwart.checkpoint.catalog import load_manifest
from stalwart.checkpoint.format import PENDING_PREFIX, step_dir
from stalwart.checkpoint.retention import RetentionPolicy, collect_garbage
from stalwart.checkpoint.storage import LocalStorage
from stalwart.cli.main import main
from stalwart.coordinator import Coordinator, CoordinatorConfig, MemoryStore
from stalwart.errors import FencedError


def _write(storage: LocalStorage, step: int, fill: int) -> None:
    data = memoryview(bytearray([fill]) * 64)
    layout = [{"id": 0, "path": ".w", "dtype": "uint8", "shape": [64], "nbytes": 64, "offset": 0}]
    write_rank(
        storage,
        step=step,
        rank=0,
        world_size=1,
        tree={"t": "dict", "items": [[".w", {"t": "tensor", "id": 0}]]},
        layout=layout,
        data=data,
        known={},
    )


def _commit(storage: LocalStorage, coord: Coordinator, step: int, gen: int, **kw: object) -> None:
    publish_step(
        storage,
        step,
        1,
        generation=gen,
        is_current=lambda g: coord.generation() == g,
        record=lambda _m: coord.record_shard_commit(gen, step, "rank0"),
        **kw,  # type: ignore[arg-type]
    )


def test_member_held_between_check_and_write_never_publishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = LocalStorage(str(tmp_path), direct_io=False)
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="job"))
    _write(storage, 4, 1)
    _commit(storage, coord, 4, 0)
    _write(storage, 10, 2)  # the old member's shard of step 10 is durable
    checked, release = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def hold(stage: str) -> None:
        if stage == "checked":  # its fence check passed; now it is stopped
            checked.set()
            assert release.wait(30)

    def old_member() -> None:
        try:
            _commit(storage, coord, 10, 0, pause=hold)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    t = threading.Thread(target=old_member)
    t.start()
    assert checked.wait(30)
    assert coord.advance_generation(0, "a member failed").won  # generation 1 fences it
    _write(storage, 6, 3)  # generation 1 rolled back and commits step 6
    _commit(storage, coord, 6, 1)
    release.set()  # the old member resumes and writes its manifest
    t.join(30)
    assert isinstance(outcome[0], FencedError)
    assert committed_steps(storage) == [4, 6]  # step 10 is visible to no reader
    assert not verify_step(storage, 10).ok
    assert load_manifest(storage, 6).generation == 1
    pending = [n for n in storage.listdir(step_dir(10)) if n.startswith(PENDING_PREFIX)]
    assert pending == []  # the refused manifest was removed, not left to be trusted
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trusted:" in out and " 10 " not in out
    gc = collect_garbage(storage, RetentionPolicy(keep_last=3))
    assert gc.deleted_steps == [] and not gc.skipped


def test_commit_recorded_before_the_fence_is_a_real_commit(tmp_path: Path) -> None:
    """Stopped after its compare-and-swap succeeded, the member publishes later: the
    coordinator accepted that commit in its generation (docs/checkpoint-format.md)."""
    storage = LocalStorage(str(tmp_path), direct_io=False)
    coord = Coordinator(MemoryStore(), CoordinatorConfig(job_id="job"))
    _write(storage, 2, 1)
    recorded, release = threading.Event(), threading.Event()

    def hold(stage: str) -> None:
        if stage == "recorded":
            assert not committed_steps(storage)  # recorded, not yet published
            recorded.set()
            assert release.wait(30)

    t = threading.Thread(target=lambda: _commit(storage, coord, 2, 0, pause=hold))
    t.start()
    assert recorded.wait(30)
    assert coord.shard_commits()["rank0"].step == 2
    release.set()
    t.join(30)
    assert committed_steps(storage) == [2] and verify_step(storage, 2).ok
