"""The test run's bytecode cache of the project's own modules (tests/_bytecode.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from _bytecode import bytecode_written, precompile


def _pyc(source: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(source)))


def test_precompile_writes_the_trees_bytecode_though_the_environment_says_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE=1
    mod = tmp_path / "src" / "pkg" / "mod.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("X = 1\n")
    script = tmp_path / "examples" / "script.py"
    script.parent.mkdir()
    script.write_text("print('hi')\n")
    other = tmp_path / "elsewhere" / "other.py"  # not a tree of the project's jobs
    other.parent.mkdir()
    other.write_text("Y = 2\n")
    assert precompile(tmp_path)
    assert _pyc(mod).is_file() and _pyc(script).is_file()
    assert not _pyc(other).exists()
    assert sys.dont_write_bytecode  # the setting itself is left as it was


def test_a_file_that_does_not_compile_is_reported_not_raised(tmp_path: Path) -> None:
    bad = tmp_path / "src" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("def (:\n")
    assert not precompile(tmp_path)


def test_bytecode_is_written_inside_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    with bytecode_written():
        assert not sys.dont_write_bytecode
    assert sys.dont_write_bytecode
    with pytest.raises(RuntimeError), bytecode_written():
        raise RuntimeError("collection failed")
    assert sys.dont_write_bytecode  # restored on an error too
