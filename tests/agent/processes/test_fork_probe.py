"""The zygote's fork probe (agent/processes/_preload.py) and the preload of a Hugging Face script:
a deadlocked child is told from one that is only slow, and transformers/Accelerate are
preloaded (their imports start no thread and run no torch op)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.processes import _preload
from stalwart.agent.processes._zygote_client import ZygoteClient


def _busy(_threads: int) -> bool:
    """Computes for about 0.6 s of CPU: far longer than the stall limit the test sets."""
    end = time.process_time() + 0.6
    while time.process_time() < end:
        pass
    return True


def _stuck(_threads: int) -> bool:
    """Sleeps on a lock no one releases, as a child waits for an OpenMP pool it lacks."""
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
    return True


@pytest.mark.process  # the probe forks a child (tests/_tiers.py)
def test_a_child_that_computes_is_waited_for(monkeypatch: Any) -> None:
    """Slow is not deadlocked: its CPU time grows (a loaded machine made the old 10 s
    wall-clock limit drop safe preloads, transformers' among them)."""
    monkeypatch.setattr(_preload, "_probe_op", _busy)
    assert _preload.fork_probe(1, stall_s=0.1, cpu_s=60.0)


@pytest.mark.process
def test_a_child_asleep_without_progress_is_deadlocked(monkeypatch: Any) -> None:
    monkeypatch.setattr(_preload, "_probe_op", _stuck)
    assert not _preload.fork_probe(1, stall_s=0.3, cpu_s=60.0)


@pytest.mark.process  # a fresh interpreter that ran a torch op on two threads
@pytest.mark.timeout(300)
def test_a_process_that_ran_a_threaded_torch_op_fails_the_probe() -> None:
    code = textwrap.dedent(
        """
        import torch
        from stalwart.agent.processes._preload import fork_probe
        ok = fork_probe(2, stall_s=2.0)  # nothing ran yet: the forked child computes
        torch.set_num_threads(2)
        a = torch.ones(512, 512)
        float((a @ a).sum())  # the OpenMP pool exists now: a forked child deadlocks
        print(ok, fork_probe(2, stall_s=2.0))
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(300)
def test_a_script_importing_transformers_and_accelerate_gets_them_preloaded(
    tmp_path: Path,
) -> None:
    """run_clm.py's and run_clm_no_trainer.py's imports: preloaded, no note, so a
    replacement worker is forked with them already imported."""
    script = tmp_path / "run_clm.py"
    script.write_text(
        "import torch\n"
        "import transformers\n"
        "from accelerate import Accelerator\n"
        "from torch.utils.data import DataLoader\n"
        "from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments\n"
        "from transformers.trainer_utils import get_last_checkpoint\n"
        "import sys\n"
        "sys.exit(0 if 'transformers.trainer' in sys.modules else 3)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    zygote = ZygoteClient(["stalwart.runtime.session"], env, script=str(script))
    try:
        ready = zygote.wait_ready(cpu_s=300.0, stall_s=120.0)
        pre = ready["preload"]
        assert pre["note"] == "", pre
        assert pre["failed"] == [], pre
        assert {"transformers", "accelerate", "transformers.trainer_utils"} <= set(pre["imported"])
        spec = {"env": env, "argv": [str(script)], "cwd": str(tmp_path), "log": None}
        zygote.send({"op": "spawn", "id": "w", "spec": spec})
        assert zygote.wait_for("exit", 120)["rc"] == 0  # forked with Trainer loaded
    finally:
        zygote.close()
