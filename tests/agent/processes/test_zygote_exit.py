"""How a zygote-forked worker ends (agent/processes/_zygote.py): as ``python script.py`` does,
without the module teardown that hung after a DDP job (destructors of the script's
globals), and without losing what the script left in unclosed files."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from stalwart.agent.processes._zygote_client import ZygoteClient

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, time

    class Stuck:  # a destructor that never returns, as a gloo group's did
        def __del__(self):
            time.sleep(600)

    stuck = Stuck()
    log = open(sys.argv[1], "w")  # never closed: its buffer must still reach the disk
    log.write("step 10 done\\n")
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))
    if len(sys.argv) > 2:
        sys.exit(int(sys.argv[2]))
    """
)


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("exit_code", [None, 3])
def test_a_worker_ends_without_tearing_down_its_globals(
    tmp_path: Path, exit_code: int | None
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "log.txt"
    argv = [str(script), str(out)] + ([] if exit_code is None else [str(exit_code)])
    zygote = ZygoteClient([], dict(os.environ), script=str(script))
    try:
        zygote.wait_for("ready", 120)
        spec = {"env": dict(os.environ), "argv": argv, "cwd": str(tmp_path), "log": None}
        zygote.send({"op": "spawn", "id": "w", "spec": spec})
        assert zygote.wait_for("exit", 120)["rc"] == (exit_code or 0)
    finally:
        zygote.close()
    assert out.read_text() == "step 10 done\n"
    assert (tmp_path / "log.txt.atexit").read_text() == "ran"


LEAKY = textwrap.dedent(
    """
    import atexit, sys

    def report():  # what nanobind's leak check does at the interpreter's teardown
        open(MARKER, "w").write("teardown ran")

    MARKER = __file__ + ".teardown"
    atexit.register(report)
    """
)


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(300)
def test_the_zygote_ends_without_an_interpreter_teardown(tmp_path: Path) -> None:
    """A preloaded module's teardown (triton's nanobind leak report, ~30 lines after
    every run) never runs in the zygote: it ends with os._exit, as its workers do."""
    (tmp_path / "tp_leaky.py").write_text(LEAKY)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    zygote = ZygoteClient(["tp_leaky"], env)
    try:
        zygote.wait_for("ready", 120)
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0
    assert not (tmp_path / "tp_leaky.py.teardown").exists(), "the zygote ran its teardown"
