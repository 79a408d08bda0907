"""A forked worker's end (agent/processes/_teardown.py): the process groups a script destroys stay
referenced until ``os._exit``, so that their destructor (which joins gloo threads that
may wait for the GIL the destructor holds) never runs; what the script sees is
unchanged. Run in a fresh interpreter: the hold is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _load import scaled

SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist
    from stalwart.agent.processes import _teardown

    _teardown.hold_destroyed_groups()
    _teardown.hold_destroyed_groups()  # once only
    from torch.distributed import destroy_process_group as patched
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    world = dist.group.WORLD
    sub = dist.new_group([0])
    dist.destroy_process_group(sub)
    patched()
    assert not dist.is_initialized()  # destroyed as the script asked
    held = _teardown._HELD
    assert any(g is sub for g in held) and any(g is world for g in held), held
    print("held", len(held))
    """
)


def test_groups_the_script_destroys_are_held_not_destructed() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=scaled(300)
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("held "), run.stdout
