"""What the zygote preloads of a script's imports (agent/processes/_preload.py)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stalwart.agent.processes._preload import preload, script_imports
from stalwart.agent.processes._zygote_client import ZygoteClient

SCRIPT = textwrap.dedent(
    """
    from __future__ import annotations
    import os, json as j
    import xml.dom
    from collections import OrderedDict, deque
    from . import sibling
    from helpers import *
    try:
        import wandb
    except ImportError:
        wandb = None
    if os.environ.get("X"):
        import csv
    else:
        import zipfile
    def main():
        import tarfile  # not top level: not preloaded
    """
)


def test_top_level_imports_are_read_without_running_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + "\nraise SystemExit('never run')\n")
    got = dict(script_imports(str(script)))
    assert got == {
        "os": (),
        "json": (),
        "xml.dom": (),
        "collections": ("OrderedDict", "deque"),
        "helpers": (),
        "wandb": (),
        "csv": (),
        "zipfile": (),
    }
    (tmp_path / "bad.py").write_text("def (:\n")
    assert script_imports(str(tmp_path / "bad.py")) == []
    assert script_imports(str(tmp_path / "absent.py")) == []


def test_the_scripts_own_modules_are_never_imported(tmp_path: Path, monkeypatch: Any) -> None:
    own = tmp_path / "proj"
    own.mkdir()
    (own / "ux_own_module.py").write_text("raise RuntimeError('ran the script code')\n")
    monkeypatch.syspath_prepend(str(own))
    res = preload([("ux_own_module", ())], local_roots=[str(own)])
    assert res.skipped == ["ux_own_module"] and "ux_own_module" not in sys.modules
    res = preload([("ux_missing_module_xyz", ())], local_roots=[str(own)])
    assert res.skipped == ["ux_missing_module_xyz"] and not res.failed


def test_installed_packages_in_a_venv_inside_the_working_directory_are_preloaded(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """``python -m venv .venv`` in the project: its site-packages lies under the working
    directory, yet holds installed packages (transformers was never preloaded so)."""
    from stalwart.agent.processes import _preload

    proj = tmp_path / "proj"
    site = proj / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "ux_venv_pkg.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(_preload, "_installed_roots", lambda: [os.path.realpath(site)])
    res = preload([("ux_venv_pkg", ())], local_roots=[str(proj)])
    assert res.imported == ["ux_venv_pkg"] and not res.skipped
    assert _preload._local(str(proj / "own.py"), [os.path.realpath(proj)], [str(site)])


def test_installed_modules_load_failures_and_slow_ones_are_reported(
    tmp_path: Path, monkeypatch: Any
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "ux_broken_pkg.py").write_text("raise RuntimeError('no GPU here')\n")
    (site / "ux_slow_pkg.py").write_text("import time\ntime.sleep(30)\n")
    (site / "ux_lazy_pkg.py").write_text(
        "def __getattr__(name):\n    import ux_lazy_target\n    return ux_lazy_target\n"
    )
    (site / "ux_lazy_target.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    for name in ("ux_broken_pkg", "ux_slow_pkg", "ux_lazy_pkg", "ux_lazy_target"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    res = preload(
        [("ux_broken_pkg", ()), ("ux_slow_pkg", ()), ("ux_lazy_pkg", ("thing",))],
        local_roots=[str(tmp_path / "proj")],
        per_import_s=0.3,
    )
    assert res.imported == ["ux_lazy_pkg"]
    assert res.failed[0] == "ux_broken_pkg: RuntimeError: no GPU here"
    assert res.failed[1].startswith("ux_slow_pkg: import took over")
    assert "ux_lazy_target" in sys.modules  # from m import a: m.a read (lazy submodules)


def test_no_alarm_is_left_armed(tmp_path: Path) -> None:
    """The per-import limit is a SIGALRM: one left armed would kill the zygote later."""
    import signal

    res = preload([("os", ()), ("json", ("dumps",))], local_roots=[str(tmp_path)])
    assert res.imported == ["json"]  # os was there already: not imported again
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(150)
def test_the_zygote_starts_again_without_imports_that_start_threads(tmp_path: Path) -> None:
    """A forked worker of a process with another thread may deadlock: such imports are
    dropped (the zygote re-executes itself) and said; workers still start and import it."""
    site, proj = tmp_path / "site", tmp_path / "proj"
    site.mkdir()
    proj.mkdir()
    (site / "ux_thread_pkg.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    script = proj / "train.py"
    script.write_text("import ux_thread_pkg\nimport sys\nsys.exit(7)\n")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    zygote = ZygoteClient([], env, script=str(script))
    try:
        ready = zygote.wait_ready(cpu_s=300.0, stall_s=120.0)
        assert ready["preload"]["imported"] == []
        assert "ux_thread_pkg" in ready["preload"]["note"]
        assert "threads" in ready["preload"]["note"]
        spec = {"env": env, "argv": [str(script)], "cwd": str(proj), "log": None}
        zygote.send({"op": "spawn", "id": "w", "spec": spec})
        assert zygote.wait_for("exit", 60)["rc"] == 7  # the worker imported it itself
    finally:
        zygote.close()


def test_an_import_stopped_midway_leaves_nothing_of_it_behind(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A package whose import the alarm stops after some of its submodules loaded: a
    worker forked from the zygote must import it whole, not over the leftovers."""
    pkg = tmp_path / "site" / "ux_half_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from ux_half_pkg import fast\nfrom ux_half_pkg import slow\nVALUE = fast.X\n"
    )
    (pkg / "fast.py").write_text("X = 7\n")
    (pkg / "slow.py").write_text("import time\ntime.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    res = preload([("ux_half_pkg", ())], local_roots=[str(tmp_path / "proj")], per_import_s=0.3)
    assert res.failed[0].startswith("ux_half_pkg: import took over")
    assert not [m for m in sys.modules if m.startswith("ux_half_pkg")], "leftovers kept"


def test_an_import_stopped_in_a_lazy_attribute_leaves_nothing_of_it_behind(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """``from transformers import Trainer``: the import of ``transformers`` finishes, the
    alarm stops the lazy ``Trainer`` (importing Accelerate) midway. The package and what
    the attribute loaded go: a worker imports them whole (seen under load: every worker
    failed with ``partially initialized module 'accelerate.big_modeling'``)."""
    site = tmp_path / "site"
    pkg = site / "ux_lazy_half"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "def __getattr__(name):\n"
        "    try:\n"
        "        import importlib\n"
        "        trainer = importlib.import_module('ux_lazy_half.trainer')\n"
        "    except Exception as err:  # as transformers' _LazyModule wraps it\n"
        "        raise ModuleNotFoundError(str(err)) from err\n"
        "    return trainer.Trainer\n"
    )
    (pkg / "trainer.py").write_text("import ux_lazy_dep\nclass Trainer: pass\n")
    (site / "ux_lazy_dep.py").write_text("import ux_lazy_done\nimport time\ntime.sleep(30)\n")
    (site / "ux_lazy_done.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(site))
    res = preload(
        [("ux_lazy_half", ("Trainer",))], local_roots=[str(tmp_path / "proj")], per_import_s=0.3
    )
    assert res.imported == [], res
    assert res.failed[0].startswith("ux_lazy_half: import took over")
    left = [m for m in sys.modules if m.startswith(("ux_lazy_half", "ux_lazy_d"))]
    assert not left, f"leftovers kept: {left}"


def test_an_import_that_computes_goes_on_past_the_window(tmp_path: Path, monkeypatch: Any) -> None:
    """The limit stops an import that waits (no CPU used in a window), not one that
    computes: on a loaded machine transformers' import took 30-100 s, and was dropped."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "ux_busy_pkg.py").write_text(
        "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0:\n    pass\nX = 1\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "ux_busy_pkg", raising=False)
    res = preload([("ux_busy_pkg", ())], local_roots=[str(tmp_path / "proj")], per_import_s=0.3)
    assert res.imported == ["ux_busy_pkg"], res.failed
