"""`stalwart report` on hostile or huge event logs (issue 27): every bad line is skipped
and counted, never a traceback, and a log of very many loss lines is read in bounded
memory (the loss series is thinned past ``LOSS_CAP``)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli.main import main
from stalwart.metrics import EventLog, events, read_events

_BAD = [
    b"not json at all",
    b"{",
    b"[]",
    b"3",
    b"null",
    b'"a string"',
    b"[" * 100_000 + b"]" * 100_000,  # deep nesting: RecursionError in json
    b'{"v":3,"t":1,"kind":"note","message":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"v":3,"t":1e999,"kind":"note","message":"inf time"}',
    # finite but no run's time: the HTML's checkpoint rug overflowed (1e308 / a column)
    b'{"v":3,"t":1e308,"kind":"snapshot","step":3,"stall_s":0.1,"bytes":1,"tier":"memory"}',
    b'{"v":3,"t":' + b"9" * 5000 + b',"kind":"note","message":"huge int"}',
    b'{"v":3,"t":' + b"9" * 400 + b',"kind":"note","message":"int beyond float"}',
    b'{"v":3,"t":NaN,"kind":"note","message":"nan"}',
    b'{"v":3,"t":"x","kind":"note","message":"string time"}',
    b'{"v":3,"t":true,"kind":"note","message":"bool time"}',
    b'{"v":3,"t":1,"kind":5}',
    b'{"v":3,"t":1,"kind":["note"],"message":"list kind"}',
    b'{"v":3,"t":1,"kind":"note","message":"m","node":"zero"}',
    b'{"v":3,"t":1,"kind":"note","message":"m","rank":1.5}',
    b'{"v":3,"t":1,"kind":"note","message":"m","pid":' + b"9" * 30 + b"}",
    b'{"v":3,"t":1,"kind":"note","message":"m","host":[1]}',
    b'{"v":3,"t":1,"kind":"snapshot","step":' + b"9" * 40 + b',"stall_s":0.1,"bytes":1,'
    b'"tier":"memory"}',
    b'{"v":3,"t":1,"kind":"snapshot","step":"1","stall_s":0.1,"bytes":1,"tier":"memory"}',
    b'{"v":3,"t":1,"kind":"loss","step":1,"value":Infinity}',
    b'{"v":3,"t":1,"kind":"no_such_kind"}',
    b'{"v":99,"t":1,"kind":"note","message":"future"}',
    b'{"t":1,"kind":"note","message":"no version"}',
    b"\xff\xfe\x00 binary",
    b"x" * (events.MAX_LINE + 10),  # longer than a line is read
]


def _report(run: Path, capsys: Any) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_each_bad_line_is_skipped_and_counted(make_run: Any, capsys: Any, tmp_path: Path) -> None:
    run = make_run("single_fault")
    with open(run / "events.jsonl", "ab") as f:
        for line in _BAD:
            f.write(line + b"\n")
    res = read_events(str(run / "events.jsonl"))
    assert res.bad_lines == len(_BAD)
    d = _report(run, capsys)
    assert d["partial"] and d["wall_s"] == 36 and d["failures"] == 1  # the good lines count
    assert f"{len(_BAD)} bad lines skipped" in " ".join(d["problems"])
    described = [p for p in d["problems"] if re.search(r"events\.jsonl:[0-9]+: ", p)]
    assert len(described) == events.MAX_PROBLEMS
    assert main(["report", str(run), "--html", str(tmp_path / "p.html")]) == 0
    assert "PARTIAL REPORT" in capsys.readouterr().out


def test_randomly_mutated_lines_never_crash_the_report(make_run: Any, capsys: Any) -> None:
    run = make_run("single_fault")
    good = (run / "events.jsonl").read_bytes().splitlines()
    rng = random.Random(27)
    alphabet = b'{}[]":,0123456789-.eE tfnaluxNI\\\x00\xff'
    mutated = []
    for _ in range(600):
        line = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(line))
            op = rng.randrange(3)
            if op == 0:
                line[pos] = rng.choice(alphabet)
            elif op == 1:
                del line[pos]
            else:
                line[pos:pos] = bytes([rng.choice(alphabet)]) * rng.randint(1, 40)
        mutated.append(bytes(line))
    with open(run / "events.jsonl", "ab") as f:
        f.write(b"\n".join(mutated) + b"\n")
    d = _report(run, capsys)
    assert d["partial"] and d["failures"] >= 1
    assert main(["report", str(run)]) == 0
    assert main(["report", str(run), "--html", str(run / "r.html")]) == 0


def test_a_long_loss_series_is_thinned_not_held_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr(events, "LOSS_CAP", 500)
    path = tmp_path / "run" / "events.jsonl"
    n = 20_000
    with EventLog(str(path), node=0) as log:
        log.emit("run_start", t=0.0, job="j", world_size=1, strategy="flash")
        for step in range(n):
            log.emit("loss", t=1.0 + step * 1e-3, step=step, value=1.0 / (step + 1))
        log.emit("run_end", t=1.0 + n * 1e-3, status="ok")
    res = read_events(str(path))
    kept = [e for e in res.events if e.kind == "loss"]
    assert 250 <= len(kept) <= 500 < n and res.loss_stride == 64
    assert not res.partial and res.bad_lines == 0
    assert [e["step"] for e in kept] == list(range(0, n, res.loss_stride))
    d = _report(path.parent, capsys)
    assert not d["partial"] and any("thinned" in p for p in d["problems"])
    assert len(d["series"]["loss"]) == len(kept)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("loop", "Too many levels of symbolic links"),
        ("long", "File name too long"),
        ("http://127.0.0.1:9/run", "No such file or directory"),
    ],
)
def test_an_unreachable_path_is_one_line(tmp_path: Path, capsys: Any, path: str, why: str) -> None:
    if path == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        path = str(tmp_path / "a")
    elif path == "long":
        path = str(tmp_path / ("x" * 5000))
    assert main(["report", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stalwart: error: ") and "\n" not in err and why in err
    assert len(err) < 400
