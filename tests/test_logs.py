"""stalwart.logs: one logger per part, one diagnostic format, installed by the entry points."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from stalwart import logs
from stalwart.cli.main import main


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    """Each test starts and ends with stalwart's handler removed (it is process-global)."""
    logs.uninstall()
    yield
    logs.uninstall()


def _record(name: str, level: int, msg: str, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise RuntimeError("inner")
        except RuntimeError:
            import sys

            info = sys.exc_info()
    return logging.LogRecord(name, level, __file__, 1, msg, None, info)


def test_one_logger_per_part_whatever_the_module() -> None:
    assert logs.get_logger("stalwart.agent.strategies._elastic") is logs.get_logger(
        "stalwart.agent"
    )
    assert logs.get_logger("stalwart.transfer.receiver").name == "stalwart.transfer"
    assert logs.get_logger("stalwart").name == "stalwart"
    with pytest.raises(ValueError, match="get_logger\\(__name__\\)"):
        logs.get_logger("torch.distributed")


def test_the_format_names_the_part_and_a_level_other_than_info() -> None:
    f = logs.DiagnosticFormatter()
    line = f.format(_record("stalwart.agent", logging.INFO, "rank 1 crashed"))
    assert line == "stalwart: agent: rank 1 crashed"
    warn = f.format(_record("stalwart.coordinator", logging.WARNING, "store: refusing"))
    assert warn == "stalwart: coordinator: warning: store: refusing"


def test_the_message_cannot_drive_the_terminal_but_a_traceback_stays() -> None:
    f = logs.DiagnosticFormatter()
    evil = f.format(_record("stalwart.transfer", logging.INFO, "peer \x1b[2Jsaid\nstalwart: ok"))
    assert evil == "stalwart: transfer: peer \\x1b[2Jsaid\\x0astalwart: ok"
    boom = f.format(_record("stalwart.coordinator", logging.ERROR, "internal", exc=True))
    head, *trace = boom.split("\n")
    assert head == "stalwart: coordinator: error: internal"
    assert trace[0].startswith("Traceback") and trace[-1] == "RuntimeError: inner"


def test_install_prints_to_the_stderr_of_now_once(capsys: pytest.CaptureFixture[str]) -> None:
    log = logs.get_logger("stalwart.runtime._x")
    log.info("before install")  # below the last-resort handler's WARNING: not printed
    logs.install()
    logs.install()  # idempotent: one handler, one line per record
    log.info("rank 0: restored step 3")
    log.debug("not at the default level")
    assert capsys.readouterr().err == "stalwart: runtime: rank 0: restored step 3\n"
    logs.uninstall()
    log.warning("gone")
    assert "stalwart: runtime" not in capsys.readouterr().err


def test_records_still_reach_the_programs_own_handlers(caplog: pytest.LogCaptureFixture) -> None:
    logs.install()
    logs.get_logger("stalwart.agent").info("seen by caplog too")
    assert [r.getMessage() for r in caplog.records] == ["seen by caplog too"]


def test_a_worker_leaves_a_program_that_configured_logging_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    logs.install_unless_configured()  # nothing configured: ours goes in
    logs.get_logger("stalwart.runtime").info("ours")
    assert capsys.readouterr().err == "stalwart: runtime: ours\n"
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    logs.install_unless_configured()  # the script configured logging: ours (inherited) goes
    logs.get_logger("stalwart.runtime").warning("theirs")
    assert capsys.readouterr().err == ""


def test_the_cli_installs_it_when_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "/nonexistent/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stalwart: error: ") and err.count("\n") == 1, err  # unchanged
    logs.get_logger("stalwart.coordinator.server").warning("store: refusing 10.0.0.9")
    assert capsys.readouterr().err == "stalwart: coordinator: warning: store: refusing 10.0.0.9\n"
