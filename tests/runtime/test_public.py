"""The public names of the worker runtime and the checkpoint engine resolve, whichever
sub-package their module lives in now (both packages import lazily, PEP 562: a name
whose module moved fails only when it is asked for)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["stalwart", "stalwart.runtime", "stalwart.checkpoint"])
def test_every_public_name_resolves(package: str) -> None:
    mod = importlib.import_module(package)
    missing = [name for name in mod.__all__ if getattr(mod, name, None) is None]
    assert not missing, f"{package}.__all__ names that do not resolve: {missing}"


def test_the_package_entry_points_are_the_runtimes() -> None:
    import stalwart
    from stalwart.runtime import GenerationGroup, Session, init
    from stalwart.runtime.comm.group import GenerationGroup as Group

    assert (stalwart.init, stalwart.Session) == (init, Session)
    assert GenerationGroup is Group
