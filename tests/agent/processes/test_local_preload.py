"""The script's own modules in the zygote (agent/processes/_local_preload.py): imported when reading
them shows only definitions, skipped with a reason otherwise, dropped when edited."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.agent.processes import _local_preload
from stalwart.agent.processes._local_preload import forget_changed, preload_local, verdict
from stalwart.agent.processes._zygote_client import ZygoteClient

CLEAN = textwrap.dedent(
    '''
    """A model file: definitions only."""
    from __future__ import annotations
    import logging
    import math
    from dataclasses import dataclass, field
    try:
        import ux_absent_optional_pkg
    except ImportError:
        ux_absent_optional_pkg = None
    logger = logging.getLogger(__name__)
    SCALE = math.pi * 2
    @dataclass
    class Config:
        width: int = 8
        names: list[str] = field(default_factory=list)
    class Block:
        kind = "mlp"
        def forward(self, x=None):
            print("only when called")
            return x
    def main():
        raise SystemExit(3)
    if __name__ == "__main__":
        main()
    '''
)


@pytest.fixture
def proj(tmp_path: Path) -> Iterator[Path]:
    """A script's directory; what a test imports from it is forgotten afterwards."""
    before = set(sys.modules)
    stamps = dict(_local_preload._stamps)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("ux_"):
            sys.modules.pop(name, None)
    _local_preload._stamps.clear()
    _local_preload._stamps.update(stamps)


def test_a_module_of_definitions_passes(proj: Path) -> None:
    (proj / "ux_model.py").write_text(CLEAN)
    assert verdict("ux_model", str(proj)) == ""


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ("import torch\ntorch.manual_seed(0)\n", "line 2: calls torch.manual_seed()"),
        ("print('hello')\n", "calls print()"),
        ("import os\nRANK = int(os.environ['RANK'])\n", "calls int()"),
        ("for i in range(3):\n    pass\n", "runs a for statement"),
        ("class A:\n    w = open('x')\n", "calls open()"),
        ("def f(x=len('ab')):\n    pass\n", "calls len()"),
        ("raise RuntimeError('no')\n", "runs a raise statement"),
    ],
)
def test_a_module_that_runs_code_at_import_is_refused(proj: Path, code: str, why: str) -> None:
    (proj / "ux_busy.py").write_text(code)
    assert why in verdict("ux_busy", str(proj))


def test_what_a_module_imports_from_the_directory_is_read_too(proj: Path) -> None:
    pkg = proj / "ux_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .model import GPT\n")
    (pkg / "model.py").write_text("from . import layers\nclass GPT:\n    pass\n")
    (pkg / "layers.py").write_text("import torch\nW = torch.ones(3)\n")
    (proj / "ux_trainer.py").write_text("from ux_pkg.model import GPT\n")
    why = verdict("ux_trainer", str(proj))
    assert why.startswith(os.path.join("ux_pkg", "layers.py")) and "torch.ones()" in why
    (pkg / "layers.py").write_text("import torch\n")
    assert verdict("ux_trainer", str(proj)) == ""


def test_preload_imports_the_clean_skips_the_rest_and_forgets_an_edited_one(proj: Path) -> None:
    (proj / "ux_model.py").write_text(CLEAN)
    (proj / "ux_side.py").write_text("import pathlib\npathlib.Path(__file__).touch()\n")
    (proj / "ux_broken.py").write_text("from ux_not_installed_anywhere import thing\n")
    script = proj / "train.py"
    items = [("os", ()), ("ux_model", ()), ("ux_side", ()), ("ux_broken", ("thing",))]
    res = preload_local(items, str(script))
    assert res.imported == ["ux_model"] and "ux_model" in sys.modules
    assert [s.split(":")[0] for s in res.skipped] == ["ux_side", "ux_broken"]
    assert "calls pathlib.Path(__file__).touch()" in res.skipped[0]
    assert "import failed: ModuleNotFoundError" in res.skipped[1]
    assert "ux_side" not in sys.modules and "ux_broken" not in sys.modules
    assert str(proj) not in sys.path
    assert forget_changed() == []  # nothing edited: the worker keeps them
    (proj / "ux_model.py").write_text(CLEAN + "\nEXTRA = 1\n")
    assert forget_changed() == ["ux_model"] and "ux_model" not in sys.modules


@pytest.mark.e2e  # a zygote process (tests/_tiers.py)
@pytest.mark.timeout(150)
def test_a_worker_finds_the_scripts_module_already_imported(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "ux_local_model.py").write_text(CLEAN)
    marker = proj / "ux_local_dirty.ran"
    (proj / "ux_local_dirty.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.ran').touch()\n"
    )
    script = proj / "train.py"
    script.write_text(
        "import sys\n"
        "had = 'ux_local_model' in sys.modules\n"
        "import ux_local_model\n"
        "import ux_local_dirty\n"
        "sys.exit(5 if had else 6)\n"
    )
    zygote = ZygoteClient([], dict(os.environ), script=str(script))
    try:
        ready = zygote.wait_ready(cpu_s=300.0, stall_s=120.0)
        assert ready["preload"]["local"] == ["ux_local_model"], ready["preload"]
        assert [s.split(":")[0] for s in ready["preload"]["local_skipped"]] == ["ux_local_dirty"]
        assert not ready["preload"]["note"]
        assert not marker.exists()  # the zygote never ran it
        spec = {"env": dict(os.environ), "argv": [str(script)], "cwd": str(proj), "log": None}
        zygote.send({"op": "spawn", "id": "w", "spec": spec})
        assert zygote.wait_for("exit", 60)["rc"] == 5  # preloaded, not imported again
        assert marker.exists()  # the worker imported the skipped one itself
    finally:
        zygote.close()
