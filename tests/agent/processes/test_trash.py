"""A lost node's /dev/shm (agent/processes/_trash.py): the name is free at once, the memory is
freed once this node recovered, or after a bound."""

from __future__ import annotations

import time
from pathlib import Path

from stalwart.agent.processes._trash import Trash


def _slots(root: Path, name: str = "slots") -> Path:
    d = root / name
    d.mkdir()
    (d / "slot0.data").write_bytes(b"x" * 4096)
    return d


def _wait_empty(root: Path) -> bool:
    deadline = time.monotonic() + 10
    while any(root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(root.iterdir())


def test_the_name_is_free_at_once_the_memory_once_recovered(tmp_path: Path) -> None:
    d = _slots(tmp_path)
    trash = Trash(max_wait_s=60.0)
    trash.add(str(d))
    assert not d.exists() and len(trash.pending) == 1
    d.mkdir()  # its next owner may create it again at once
    trash.collect(recovered=False)  # still recovering: nothing is freed
    (renamed,) = trash.pending
    assert Path(renamed).exists()
    trash.collect(recovered=True)
    assert trash.pending == []
    trash.close()
    assert not Path(renamed).exists() and d.exists()


def test_a_recovery_that_never_ends_does_not_keep_the_memory(tmp_path: Path) -> None:
    trash = Trash(max_wait_s=0.0)
    trash.add(str(_slots(tmp_path)))
    trash.collect(recovered=False)
    assert trash.pending == [] and _wait_empty(tmp_path)
    trash.close()


def test_missing_paths_are_ignored_and_close_frees_what_is_pending(tmp_path: Path) -> None:
    trash = Trash(max_wait_s=60.0)
    trash.add(str(tmp_path / "never-there"))
    assert trash.pending == []
    trash.add(str(_slots(tmp_path, "a")))
    trash.add(str(_slots(tmp_path, "b")))
    trash.close()
    assert not any(tmp_path.iterdir())
