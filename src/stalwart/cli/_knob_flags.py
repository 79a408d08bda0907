"""`stalwart run`'s runtime flags, generated from the worker contract's fields.

Each runtime knob is defined once, as a field of :class:`~stalwart.contract.env.WorkerEnv`
marked ``knob``: its flag, type, bounds, choices and default, and its docstring, which is
the flag's help here. This module only places a knob's flag in its argument group
(:func:`knob_flag`) and, after parsing, builds the knobs back into a contract
(:func:`runtime_knobs`), which checks them with the contract's own bounds. What is not
in a field stays here: ``--persist-every auto`` and its default by strategy, and the
``--outer`` preset of the outer step (cli/_async_flags.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from stalwart.contract.docstrings import field_docs
from stalwart.contract.env import KNOBS, WorkerEnv, check_value
from stalwart.contract.strategy import Strategy
from stalwart.errors import ConfigError

__all__ = ["knob_flag", "knob_help", "runtime_knobs"]

_FIELDS = {f.name: f for f in dataclasses.fields(WorkerEnv)}
_COUNT = re.compile(r"-?[0-9]{1,9}", re.ASCII)
# the knobs whose default `stalwart run` decides after parsing (None: not given)
_LATE = frozenset({"persist_every", "outer_lr", "outer_momentum"})
# named values of a knob on the command line
_WORDS = {"persist_every": {"auto": -1}}


def knob_help(name: str) -> str:
    """The help of knob ``name``'s flag: its field's docstring."""
    return field_docs(WorkerEnv)[name]


def _default_said(name: str, default: object) -> str:
    """`` (default: N)`` after a knob's help, as argparse users expect; a knob whose
    default `stalwart run` decides after parsing says so in its docstring instead."""
    if name in _LATE:
        return ""
    shown = default.value if hasattr(default, "value") else default
    return f" (default: {shown})"


def knob_flag(group: Any, name: str) -> None:
    """Add knob ``name``'s flag (the contract field's ``flag``) to ``group``."""
    f = _FIELDS[name]
    meta = f.metadata
    kwargs: dict[str, Any] = {
        "dest": name,
        "default": None if name in _LATE else f.default,
        "help": knob_help(name).replace("%", "%%") + _default_said(name, f.default),
    }
    if meta["choices"]:
        kwargs["choices"] = meta["choices"]
    else:  # named for the flag, not the field (--collective-timeout COLLECTIVE_TIMEOUT)
        kwargs["metavar"] = meta["flag"].lstrip("-").upper().replace("-", "_")
        if name not in _WORDS:
            kwargs["type"] = type(f.default)
    group.add_argument(meta["flag"], **kwargs)


def _word(name: str, text: str) -> int:
    words = _WORDS[name]
    if text in words:
        return words[text]
    if not _COUNT.fullmatch(text):
        flag, named = _FIELDS[name].metadata["flag"], " or ".join(map(repr, words))
        raise ConfigError(f"{flag} {text!r}: use a number of steps or {named}")
    return int(text)


def runtime_knobs(
    args: argparse.Namespace, strategy: Strategy, outer: tuple[float, float]
) -> WorkerEnv:
    """The parsed knobs as a contract (every other field at its default), checked by the
    contract's bounds, with the flag named in the error; ``outer``: (outer lr, momentum)
    of ``--outer``."""
    values: dict[str, Any] = {name: getattr(args, name) for name in KNOBS}
    given = values["persist_every"]
    if given is None:  # a job without memory restores persists by default
        values["persist_every"] = 0 if strategy.restores_from_memory else 20
    else:
        values["persist_every"] = _word("persist_every", given)
    values["outer_lr"], values["outer_momentum"] = outer
    for name, value in values.items():
        check_value(name, value, _FIELDS[name].metadata["flag"], "see `stalwart run --help`")
    return WorkerEnv(**values)
