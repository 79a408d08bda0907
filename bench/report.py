"""`make bench` (issue 34): run the benches on the harness, keep their JSON lines, and
write docs/benchmarks.md from them: one table per bench (figure, median, min, max, n,
valid), with the load, versions, machine, date and commit it ran at.

    python bench/report.py [--quick] [--only routes,node_loss] [--keep] [--render-only]

Default: each bench at its default size with 3 repetitions (the route table: 1 run, its
spread from its >= 5 faults per route). ``--quick``: 1 repetition at small sizes (a look
that it all runs; its figures have no spread and are not the documented ones).
Results go to bench/results/latest.json (``{"benches": {name: line}, "date", "commit",
"quick"}``; bench/regress.py compares two such files) and the page to
docs/benchmarks.md. ``--render-only`` writes the page from the results file as it is;
``--keep`` keeps the lines of the benches not rerun from the results file (each bench's
section says when and at which commit it ran). The route table compare wrote in the
routes bench's run (its ``routes.md``) goes into the page and into docs/routes.md,
between the ``<!-- bench:routes -->`` markers: docs/routes.md's table is that output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "latest.json"
PAGE = ROOT / "docs" / "benchmarks.md"
ROUTES_PAGE = ROOT / "docs" / "routes.md"
MARKS = ("<!-- bench:routes -->", "<!-- /bench:routes -->")

# name: (script, full-size args, quick args)
BENCHES: dict[str, tuple[str, list[str], list[str]]] = {
    "checkpoint": ("checkpoint.py", ["--reps", "3"], ["--size-gb", "0.25", "--reps", "1"]),
    "detection": ("detection.py", ["--reps", "3"], ["--reps", "1"]),
    "node_loss": (
        "node_loss.py",
        ["--reps", "3"],
        ["--reps", "1", "--size-mb", "64", "--only", "steady-off,steady-on,loss-memory,loss-disk"],
    ),
    "routes": (
        "routes.py",
        ["--reps", "1"],
        [
            "--reps",
            "1",
            "--faults",
            "2",
            "--trace",
            "kill every=8s",
            "--routes",
            "torchrun,restart,flash",
        ],
    ),
}


def run_bench(name: str, quick: bool, routes: str = "") -> dict[str, Any]:
    """Run one bench; its final JSON line (or an invalid line saying why there is none).
    ``routes``: more arguments of the routes bench (``--routes-args``). The bench's own
    lines are shown as they come, each with the bench's name and the minutes it has run
    (a default-size bench runs for many minutes: a silent one looks hung)."""
    script, full, small = BENCHES[name]
    cmd = [sys.executable, str(HERE / script), *(small if quick else full)]
    cmd += shlex.split(routes) if name == "routes" else []
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not line.startswith("{"):  # the final JSON line is kept, not echoed
                print(f"[{name} {(time.monotonic() - t0) / 60:5.1f} min] {lines[-1]}", flush=True)
    print(f"== {name}: exited {proc.returncode} after {(time.monotonic() - t0) / 60:.1f} min")
    lines = [ln for ln in lines if ln.strip()]
    try:
        doc = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        return {"valid": False, "invalid": [f"{script} exited {proc.returncode}, no JSON line"]}
    table = Path(str(doc.get("work_dir", ""))) / "rep0" / "routes.md"
    if name == "routes" and doc.get("work_dir") and table.is_file():
        doc["table_md"] = table.read_text()  # compare's table of the run (docs/routes.md)
    return doc


def routes_table(routes_doc: Mapping[str, Any], page: str) -> str:
    """``page`` (docs/routes.md) with compare's table of the routes bench's run between
    the markers (unchanged when the run left no table or the page has no markers)."""
    table = routes_doc.get("table_md")
    start, end = MARKS
    if not table or start not in page or end not in page:
        return page
    head, rest = page.split(start, 1)
    tail = rest.split(end, 1)[1]
    body = "\n".join(ln for ln in str(table).splitlines() if not ln.startswith("# "))
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _commit() -> str:
    got = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return got.stdout.strip() or "unknown"


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _bench_section(name: str, doc: Mapping[str, Any]) -> list[str]:
    out = [f"## {name}", ""]
    ran = doc.get("ran")
    if isinstance(ran, Mapping):
        only = f"; {ran['only']}" if ran.get("only") else ""
        ended = f" to {ran['ended']}" if ran.get("ended") else ""
        out += [f"ran: {ran.get('date')}{ended}, commit {ran.get('commit')}{only}", ""]
    valid = doc.get("valid")
    out.append(f"valid: **{'yes' if valid else 'no'}**")
    out += [f"- invalid: {why}" for why in doc.get("invalid", [])]
    loads = doc.get("load", [])
    if loads:
        seen = ", ".join(f"{x['before']:.1f} -> {x['after']:.1f}" for x in loads)
        out.append(f"\nload (1-min average, before -> after each repetition): {seen}")
    if doc.get("versions"):
        vers = ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v)
        out.append(f"\nversions: {vers}; machine: {_machine(doc.get('machine', {}))}")
    for key in ("best", "best_vs_torchrun", "best_lost_vs_torchrun", "best_ettr"):
        if key in doc:
            out.append(f"\n{key}: {_cell(doc[key])}")
    out += ["", "| figure | median | min | max | n | valid |", "|---|---|---|---|---|---|"]
    for fig, s in doc.get("spread", {}).items():
        ok = "yes" if s.get("valid", True) else "**no**"
        cells = [_cell(float(s[k])) for k in ("median", "min", "max")]
        out.append(f"| {fig} | {' | '.join(cells)} | {s['n']} | {ok} |")
    if doc.get("table_md"):
        out += ["", "compare's table of this run (also in docs/routes.md):", ""]
        out += [ln for ln in str(doc["table_md"]).splitlines() if not ln.startswith("# ")]
    return [*out, ""]


def _machine(m: Mapping[str, Any]) -> str:
    return f"{m.get('cores')} cores, {m.get('memory_gb')} GiB"


def render(results: Mapping[str, Any]) -> str:
    """docs/benchmarks.md from a results document (module docstring)."""
    kind = (
        "quick (1 repetition, small sizes: not the documented figures)"
        if results.get("quick")
        else "default size"
    )
    head = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (bench/report.py) from bench/results/latest.json: do not",
        "edit by hand; rerun it. Every figure is the median over the repetitions with its",
        "min and max; a figure marked not valid (a repetition failed, a fault-trace run met",
        "fewer faults than asked, the load from outside the bench changed > 2x within a",
        "pair) gives no verdict.",
        "Compare two runs with `python bench/regress.py OLD.json NEW.json`.",
        "",
        f"Run: {results.get('date')}, commit {results.get('commit')}, {kind}.",
        "",
    ]
    body: list[str] = []
    for name, doc in results.get("benches", {}).items():
        body += _bench_section(name, doc)
    return "\n".join(head + body)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 repetition, small sizes")
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated benches")
    p.add_argument("--render-only", action="store_true", help="write the page from results")
    p.add_argument("--keep", action="store_true", help="keep the other benches' lines")
    p.add_argument("--routes-args", default="", help="more arguments of bench/routes.py")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--page", default=str(PAGE))
    p.add_argument("--routes-page", default=str(ROUTES_PAGE))
    args = p.parse_args(argv)
    results_path = Path(args.results)
    if not args.render_only:
        names = [n for n in args.only.split(",") if n]
        unknown = [n for n in names if n not in BENCHES]
        if unknown:
            print(f"bench/report.py: unknown bench(es) {unknown}; known: {sorted(BENCHES)}")
            return 2
        old = json.loads(results_path.read_text()) if args.keep and results_path.is_file() else {}
        if old and bool(old.get("quick")) != args.quick:
            print("bench/report.py: --keep mixes a quick run with a full one; rerun all")
            return 2
        benches = dict(old.get("benches", {}))
        results_path.parent.mkdir(parents=True, exist_ok=True)
        for n in names:
            ran = {"date": _now(), "commit": _commit()}  # when it began
            if n == "routes" and args.routes_args:
                ran["only"] = f"bench/routes.py {args.routes_args}"
            benches[n] = {**run_bench(n, args.quick, args.routes_args), "ran": ran}
            ran["ended"] = _now()
            # written after each bench: an interrupted `make bench` keeps what finished
            # (rerun the rest with --keep --only)
            results = {"date": _now(), "commit": _commit(), "quick": args.quick}
            results_path.write_text(json.dumps({**results, "benches": benches}, indent=1) + "\n")
    elif not results_path.is_file():
        print(f"bench/report.py: {results_path} not found; run without --render-only first")
        return 2
    results = json.loads(results_path.read_text())
    Path(args.page).write_text(render(results))
    routes_page = Path(args.routes_page)
    if "routes" in results["benches"] and routes_page.is_file():
        page = routes_page.read_text()
        routes_page.write_text(routes_table(results["benches"]["routes"], page))
    bad = [n for n, d in results["benches"].items() if not d.get("valid")]
    print(f"wrote {args.page}; invalid: {', '.join(bad) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
