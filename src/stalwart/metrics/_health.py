"""The report's node health section: the health probes' last readings per node, each
probe failure with what the agent did about it, and the preflight node check's verdicts
with their figures (``probe`` and ``preflight`` events, agent/health/_node.py and
agent/health/preflight.py; docs/detection.md).

Why derived from the log alone: the agent writes a probe's first reading and then only
its changes, so the last ``probe`` event of a (node, probe, device, rank) is its current
reading, and a failure's outcome is the next ``isolation`` (the node was blocklisted) or
``note`` (it stayed, and why) that names it. A skipped probe (no pynvml, no GPU) is a
reading, never a failure.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from stalwart.metrics.events import Event

__all__ = ["health_html", "health_lines", "health_section"]

_FIGURES = ("matmul_s", "allreduce_s", "retest_allreduce_s")


def _where(e: Event) -> dict[str, Any]:
    dom = e.get("domain")
    dom = dom if isinstance(dom, dict) else {}
    node = dom.get("node", e.node)
    return {"node": node, "rank": dom.get("rank"), "device": dom.get("device")}


def _reading(e: Event, t0: float) -> dict[str, Any]:
    return {
        "t": e.t - t0,
        "probe": e["probe"],
        **_where(e),
        "ok": bool(e["ok"]),
        "skipped": bool(e.get("skipped", False)),
        "value": e.get("value"),
        "limit": e.get("limit"),
        "unit": e.get("unit"),
        "detail": e["detail"],
    }


def _action(later: Sequence[Event], member: str, node: Any, cause: str) -> str:
    """What the agent did after a failure whose isolation reason starts with ``cause``."""
    for e in later:
        if e.kind == "isolation" and e["member"] == member and str(e["reason"]).startswith(cause):
            return "isolated (blocklisted)" if e.get("blocklisted", True) else "isolated"
        msg = str(e["message"]) if e.kind == "note" else ""
        if msg.startswith(f"node {node}: {cause}"):
            return "stayed: " + msg.rsplit("; ", 1)[-1]
    return "reported"


def _failures(events: Sequence[Event], t0: float) -> list[dict[str, Any]]:
    out = []
    for i, e in enumerate(events):
        if e.kind != "probe" or e["ok"] or e.get("skipped", False):
            continue
        row = _reading(e, t0)
        key = (row["probe"], row["node"], row["device"], row["rank"])
        later = events[i + 1 :]
        if row["rank"] is not None:  # a worker's own refusal (the shm probe of a snapshot)
            row["action"] = "snapshot refused until it fits"
        else:
            cause = f"probe {row['probe']} failed"
            row["action"] = _action(later, f"node{row['node']}", row["node"], cause)
        back = next((x for x in later if x.kind == "probe" and x["ok"] and _key(x) == key), None)
        row["healthy_again_t"] = None if back is None else back.t - t0
        out.append(row)
    return out


def _key(e: Event) -> tuple[Any, ...]:
    w = _where(e)
    return (e["probe"], w["node"], w["device"], w["rank"])


def _preflight(events: Sequence[Event], t0: float) -> list[dict[str, Any]]:
    out = []
    for i, e in enumerate(events):
        if e.kind != "preflight":
            continue
        member = str(e["member"])
        node = member[4:] if member.startswith("node") else member
        row: dict[str, Any] = {"t": e.t - t0, "member": member, "ok": bool(e["ok"])}
        row["verdict"] = e["verdict"]
        for k in _FIGURES:  # -1 is a failed check's "no figure"
            v = e.get(k)
            row[k] = v if isinstance(v, int | float) and v >= 0 else None
        row.update(partner=e.get("partner"), retest_partner=e.get("retest_partner"))
        row["seconds"] = e.get("seconds")
        cause = "preflight"
        row["action"] = "-" if row["ok"] else _action(events[i + 1 :], member, node, cause)
        out.append(row)
    return out


def health_section(events: Sequence[Event], t0: float) -> dict[str, Any]:
    """The JSON document's ``health``: ``probes`` (last reading per node, probe, device
    and rank), ``probe_failures`` and ``preflight`` (one row per node checked)."""
    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e.kind == "probe":
            last[_key(e)] = _reading(e, t0)
    order = sorted(last.values(), key=lambda r: (str(r["node"]), r["probe"], str(r["device"])))
    return {
        "probes": order,
        "probe_failures": _failures(events, t0),
        "preflight": _preflight(events, t0),
    }


def _num(x: Any, fmt: str) -> str:
    return "-" if not isinstance(x, int | float) or isinstance(x, bool) else format(x, fmt)


def _ms(x: Any) -> str:
    return "-" if not isinstance(x, int | float) else f"{1000 * x:.1f} ms"


def _who(r: dict[str, Any]) -> str:
    dev = "" if r["device"] is None else f" gpu {r['device']}"
    rank = "" if r["rank"] is None else f" rank {r['rank']}"
    return f"node {r['node']}{rank}{dev}"


def health_lines(h: dict[str, Any]) -> list[str]:
    """The terminal summary's lines (control characters are escaped by the caller)."""
    probes, fails, pre = h.get("probes", []), h.get("probe_failures", []), h.get("preflight", [])
    if not (probes or pre):
        return []
    bad = sum(1 for r in probes if not r["ok"])
    nodes = len({r["node"] for r in probes})
    lines = [
        f"node health: {len(probes)} probe readings on {nodes} node(s), {bad} failing now, "
        f"{len(fails)} failure(s) in the run"
    ]
    lines += [
        f"  probe {r['probe']} failed on {_who(r)} at {r['t']:.1f}s: {r['detail']}; "
        f"{r['action']}" + _again(r["healthy_again_t"])
        for r in fails
    ]
    lines += [
        f"  preflight {r['member']}: {r['verdict']} (matmul {_ms(r['matmul_s'])}, allreduce "
        f"{_ms(r['allreduce_s'])}{_partner(r['member'], r['partner'])}"
        + ("" if r["retest_partner"] is None else
           f", again {_ms(r['retest_allreduce_s'])} with node {r['retest_partner']}")
        + f"){'' if r['ok'] else '; ' + r['action']}"
        for r in pre
    ]  # fmt: skip
    return lines


def _partner(member: str, partner: Any) -> str:
    if partner is None:
        return ""
    return " within the node" if member == f"node{partner}" else f" with node {partner}"


def _again(t: Any) -> str:
    return "" if t is None else f"; healthy again at {t:.1f}s"


def _table(ident: str, cols: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in rows)  # fmt: skip
    return f'<table id="{ident}"><tr>{th}</tr>{body}</table>'


def _state(r: dict[str, Any]) -> str:
    return "skipped" if r["skipped"] else ("ok" if r["ok"] else "FAILING")


def _quantity(x: Any, unit: Any) -> str:
    """A reading in the unit a reader thinks in: bytes as MiB, a fraction as a percent."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return "-"
    if unit == "bytes":
        return f"{x / 2**20:.0f} MiB"
    if unit == "fraction":
        return f"{100 * x:.1f}%"
    return f"{x:.4g} {unit}" if unit else f"{x:.4g}"


def _value(r: dict[str, Any]) -> str:
    return _quantity(r["value"], r.get("unit"))


def _limit(r: dict[str, Any]) -> str:
    return _quantity(r["limit"], r.get("unit"))


def health_html(h: dict[str, Any]) -> str:
    """The HTML section (its heading included)."""
    head = "<h2>Node health</h2>"
    probes, fails, pre = h.get("probes", []), h.get("probe_failures", []), h.get("preflight", [])
    if not (probes or pre):
        return head + "<p>No probe reading nor preflight check in this log (probes off).</p>"
    parts = [head, "<h3>Probes: last reading</h3>"]
    parts.append(_table("probes", ["node", "probe", "device / rank", "state", "value", "bound",
                                   "since (s)", "detail"], [
        [str(r["node"]), r["probe"], _device(r), _state(r), _value(r), _limit(r),
         _num(r["t"], ".1f"), r["detail"]] for r in probes]))  # fmt: skip
    parts.append("<h3>Probe failures</h3>")
    parts.append(_table("probe-failures", ["at (s)", "node", "probe", "device / rank", "value",
                                           "detail", "what the agent did", "healthy again (s)"], [
        [_num(r["t"], ".1f"), str(r["node"]), r["probe"], _device(r), _value(r), r["detail"],
         r["action"], _num(r["healthy_again_t"], ".1f")] for r in fails])
        if fails else "<p>No probe failed.</p>")  # fmt: skip
    if pre:
        parts.append("<h3>Preflight node check</h3>")
        parts.append(_table("preflight", ["node", "verdict", "matmul", "allreduce", "partner",
                                          "retest allreduce", "retest partner", "check (s)",
                                          "what the agent did"], [
            [r["member"], r["verdict"], _ms(r["matmul_s"]), _ms(r["allreduce_s"]),
             _opt(r["partner"]), _ms(r["retest_allreduce_s"]), _opt(r["retest_partner"]),
             _num(r["seconds"], ".1f"), r["action"]] for r in pre]))  # fmt: skip
    return "".join(parts)


def _opt(x: Any) -> str:
    return "-" if x is None else str(x)


def _device(r: dict[str, Any]) -> str:
    bits = [f"gpu {r['device']}" if r["device"] is not None else "",
            f"rank {r['rank']}" if r["rank"] is not None else ""]  # fmt: skip
    return " ".join(b for b in bits if b) or "-"
