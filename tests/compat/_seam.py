"""The check every tests/compat/ test makes: an internal of another project that a
function of src/stalwart/compat/ relies on is still there, in the shape it relies on;
otherwise the failure names the internal, the installed version and the function to
adapt."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

__all__ = ["changed", "relied_on"]


def changed(what: str, version: str, by: str, how: str) -> str:
    """The one-line failure: ``what`` changed ``how`` on ``version``; ``by`` relies on it."""
    return (
        f"{what} {how} on {version}: stalwart.compat.{by} relies on it; adapt that function "
        "(its docstring says what it needs and why) or install the tested version"
    )


def relied_on(
    owner: Any,
    name: str,
    *,
    version: str,
    by: str,
    params: Sequence[str] | None = None,
    label: str | None = None,
) -> Any:
    """``owner.name``, asserting it exists and, with ``params``, that its signature
    starts with those parameter names (``self`` not counted)."""
    what = f"{label or getattr(owner, '__name__', type(owner).__name__)}.{name}"
    assert hasattr(owner, name), changed(what, version, by, "is gone")
    attr = getattr(owner, name)
    if params is not None:
        try:
            names = [p for p in inspect.signature(attr).parameters if p != "self"]
        except (TypeError, ValueError):  # a C function without a signature: its docstring
            doc = (getattr(attr, "__doc__", "") or "").split("\n")[0]
            names = [p for p in params if p in doc]
        assert names[: len(params)] == list(params), changed(
            what, version, by, f"takes {names}, not {list(params)}"
        )
    return attr
