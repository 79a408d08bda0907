"""Event strings reach a terminal escaped: `stalwart report` and the live console."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.logs import terminal_safe
from stalwart.metrics import EventLog
from stalwart.metrics.console import ConsoleProgress

EVIL = "\x1b]0;owned\x07\x1b[2J\u202e\x9b"


def test_terminal_safe_escapes_controls_only() -> None:
    assert terminal_safe(EVIL) == "\\x1b]0;owned\\x07\\x1b[2J\\u202e\\x9b"
    assert terminal_safe("a\nb\tc") == "a\\x0ab\\x09c"
    assert terminal_safe("a\nb\x1b", newlines=True) == "a\nb\\x1b"
    assert terminal_safe("plain ü 数据 ✓") == "plain ü 数据 ✓"


def test_report_escapes_event_strings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with EventLog(str(run / "events.jsonl"), node=0) as log:
        log.emit("run_start", t=1.0, job=EVIL, world_size=2, strategy="flash\x1b[31m")
        forged = "kill\x1b[8m\nincident 9: forged"  # the incident line prints the fault
        log.emit("fault_injected", t=2.0, fault=forged, domain={"rank": 1, "node": 0})
        log.emit(
            "fault_detected", t=2.5, fault="crash", domain={"rank": 1, "node": 0}, latency_s=0.5
        )
        log.emit("run_end", t=5.0, status="ok\x1b[A")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out and "\x9b" not in out
    assert "\\x1b]0;owned" in out and "strategy=flash\\x1b[31m" in out
    assert "incident 0: kill\\x1b[8m\\x0aincident 9: forged" in out  # no forged line


def test_console_escapes_event_strings() -> None:
    for tty in (True, False):
        out = io.StringIO()
        console = ConsoleProgress(out, tty=tty)
        console.emit("run_start", t=0.0, job="j", world_size=1, strategy="flash")
        console.emit("fault_injected", t=1.0, fault=EVIL, domain={"rank": 0, "node": 0})
        console.emit("run_end", t=2.0, status="failed\x1b[2K")
        console.close()
        text = out.getvalue()
        if tty:  # the console's own in-place redraw is the only ESC sequence
            text = text.replace("\r\x1b[K", "").replace("\x1b[K", "")
        assert "\x1b" not in text and "\x07" not in text, repr(text)
        assert "\\x1b]0;owned" in text and "failed\\x1b[2K" in text
