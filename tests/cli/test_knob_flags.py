"""One knob, one definition: `stalwart run`'s runtime flags are generated from the worker
contract's fields (cli/_knob_flags.py), each with the field's docstring as its help."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from stalwart.cli._async_flags import outer_settings
from stalwart.cli._knob_flags import runtime_knobs
from stalwart.cli.main import build_parser, main
from stalwart.contract.docstrings import field_docs
from stalwart.contract.env import DEFAULTS, KNOBS, WorkerEnv, knob_values
from stalwart.contract.strategy import Strategy


def _run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["run"]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def test_every_knob_has_exactly_one_flag_whose_help_is_its_docstring() -> None:
    actions = _run_parser()._actions
    docs = field_docs(WorkerEnv)
    assert len(KNOBS) >= 15
    for f in dataclasses.fields(WorkerEnv):
        if not f.metadata["knob"]:
            continue
        flag = f.metadata["flag"]
        mine = [a for a in actions if flag in a.option_strings]
        assert len(mine) == 1, f"{f.name}: {len(mine)} flags {flag} in `stalwart run`"
        assert [a for a in actions if a.dest == f.name] == mine, f"{f.name}: another flag sets it"
        assert mine[0].help is not None
        shown = mine[0].help.replace("%%", "%")
        said = (
            ""
            if mine[0].default is None
            else f" (default: {getattr(f.default, 'value', f.default)})"
        )
        assert shown == docs[f.name] + said, f"{flag}'s help is not its docstring and default"


def test_every_knob_field_is_documented_and_flagged() -> None:
    docs = field_docs(WorkerEnv)
    for name in KNOBS:
        meta = next(f.metadata for f in dataclasses.fields(WorkerEnv) if f.name == name)
        assert meta["flag"].startswith("--") and docs.get(name), name


def _knobs(*flags: str, strategy: Strategy = Strategy.FLASH) -> dict[str, object]:
    args = _run_parser().parse_args([*flags, "train.py"])
    return knob_values(runtime_knobs(args, strategy, outer_settings(args)))


def test_the_generated_flags_default_to_the_contract() -> None:
    assert _knobs() == knob_values(DEFAULTS)
    assert _knobs(strategy=Strategy.RESTART)["persist_every"] == 20  # persists by default
    assert _knobs("--persist-every", "auto")["persist_every"] == -1
    got = _knobs("--keep-last", "5", "--on-nan", "rollback", "--spike-z", "2.5")
    assert (got["keep_last"], got["on_nan"], got["spike_z"]) == (5, "rollback", 2.5)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--keep-last", "0"], "--keep-last=0 is out of bounds (need >= 1)"),
        (["--collective-timeout", "0"], "--collective-timeout=0.0 is out of bounds (need > 0)"),
        (["--spike-window", "1"], "--spike-window=1 is out of bounds (need >= 2)"),
        (["--persist-every", "-2"], "--persist-every=-2 is out of bounds (need >= -1)"),
        (["--snapshot-budget", "inf"], "--snapshot-budget=inf is not a finite number"),
    ],
)
def test_a_knob_out_of_its_contract_bounds_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert not run_dir.exists()
