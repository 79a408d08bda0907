"""Network faults between the hosts of a :class:`~hosts._lab.Lab`, as a small spec.

One fault a clause, clauses joined by ``;``::

    partition 0<->1            both ways, every packet between the hosts dropped
    partition 1->0             one way: what host 1 sends to host 0 is dropped
    partition 1->0:29400       host 1 cut from host 0's port 29400 only (the control plane:
                               both directions of those connections), the rest intact
    loss 0<->1 30%             30% of the packets dropped at random, both ways
    delay 1->0:29400 200ms     host 1's connections to host 0's port 29400 delayed 200 ms
    ... for 30s                any fault above healed after 30 s (default: permanent)

Drops are silent (a blackhole: no RST, no ICMP), as a cut link or a dead switch port is:
they are nftables rules in the ``bridge`` family on the lab's bridge, one chain a fault,
so healing one is flushing its chain. Delay is not a kernel qdisc (``sch_netem`` is not in
every kernel): it is a userspace TCP forwarder in the sending host (``_forward.py``) that
the host's connections to that port are redirected to; hence delay needs a port.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["NetFault", "NetSpecError", "nft_rules", "parse_net"]

Kind = Literal["partition", "loss", "delay"]
_KINDS: tuple[Kind, ...] = ("partition", "loss", "delay")

_CLAUSE = re.compile(
    r"^(?P<kind>[a-z]+)\s+(?P<a>\d+)(?P<arrow><->|->)(?P<b>\d+)(?::(?P<port>\d+))?"
    r"(?:\s+(?P<amount>\d+)(?P<unit>%|ms))?(?:\s+for\s+(?P<dur>\d+(?:\.\d+)?)s)?$"
)


class NetSpecError(ValueError):
    """A network fault spec that does not parse; the message names the clause."""


@dataclass(frozen=True)
class NetFault:
    """One network fault between two hosts of the lab."""

    kind: Kind
    """partition (drop all), loss (drop ``percent`` at random) or delay (``delay_ms``)."""
    src: int
    """The host whose packets are dropped or delayed (for ``both``: one of the two)."""
    dst: int
    """The host they were sent to."""
    both: bool = False
    """Both directions (``<->``), not only ``src`` to ``dst``."""
    port: int | None = None
    """Only TCP connections from ``src`` to this port of ``dst`` (both directions of
    them): a cut control plane with the data plane intact."""
    percent: int = 0
    """loss: the share of packets dropped, 1-100."""
    delay_ms: int = 0
    """delay: added to every chunk the forwarder passes on."""
    duration_s: float | None = None
    """Healed after this many seconds (None: permanent)."""

    def render(self) -> str:
        """The spec clause for this fault (``parse_net(f.render()) == [f]``)."""
        arrow = "<->" if self.both else "->"
        text = f"{self.kind} {self.src}{arrow}{self.dst}"
        if self.port is not None:
            text += f":{self.port}"
        if self.kind == "loss":
            text += f" {self.percent}%"
        if self.kind == "delay":
            text += f" {self.delay_ms}ms"
        if self.duration_s is not None:
            text += f" for {self.duration_s:g}s"
        return text


def _clause(text: str) -> NetFault:
    m = _CLAUSE.match(text)
    if m is None:
        raise NetSpecError(
            f"network fault {text!r}: write KIND A<->B or A->B[:PORT] [N% | Nms] [for Ns], "
            f"KIND one of {', '.join(_KINDS)}"
        )
    kind = m["kind"]
    if kind not in _KINDS:
        raise NetSpecError(f"network fault {text!r}: {kind!r} is not one of {', '.join(_KINDS)}")
    src, dst = int(m["a"]), int(m["b"])
    if src == dst:
        raise NetSpecError(f"network fault {text!r}: a host cannot be cut from itself")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise NetSpecError(f"network fault {text!r}: port {port} is not 1-65535")
    amount, unit = (int(m["amount"]), m["unit"]) if m["amount"] else (None, None)
    want = {"partition": None, "loss": "%", "delay": "ms"}[kind]
    if unit != want:
        need = {None: "no amount", "%": "a percent (30%)", "ms": "a delay (200ms)"}[want]
        raise NetSpecError(f"network fault {text!r}: {kind} takes {need}")
    if kind == "loss" and not (amount is not None and 0 < amount <= 100):
        raise NetSpecError(f"network fault {text!r}: loss is 1-100%")
    if kind == "delay" and port is None:
        raise NetSpecError(f"network fault {text!r}: delay needs a port (A->B:PORT)")
    dur = float(m["dur"]) if m["dur"] else None
    if dur is not None and dur <= 0:
        raise NetSpecError(f"network fault {text!r}: 'for' must be > 0 s")
    return NetFault(
        kind=kind,  # type: ignore[arg-type]  # checked against _KINDS above
        src=src,
        dst=dst,
        both=m["arrow"] == "<->",
        port=port,
        percent=amount if kind == "loss" and amount is not None else 0,
        delay_ms=amount if kind == "delay" and amount is not None else 0,
        duration_s=dur,
    )


def parse_net(spec: str) -> list[NetFault]:
    """Every fault of ``spec`` (``;``-separated clauses), in order."""
    clauses = [c.strip() for c in spec.split(";") if c.strip()]
    if not clauses:
        raise NetSpecError("network fault spec names no fault")
    return [_clause(" ".join(c.split())) for c in clauses]


def _one_way(f: NetFault, src: str, dst: str, reverse: bool) -> list[str]:
    """The drop rules for packets ``src`` -> ``dst`` (``reverse``: the replies of a
    port-limited fault, which come from the port)."""
    match = f"ip saddr {src} ip daddr {dst}"
    if f.port is not None:
        match += f" tcp sport {f.port}" if reverse else f" tcp dport {f.port}"
    random = f.kind == "loss" and f.percent < 100  # (nft refuses "< 100": 0-99 only)
    verdict = f"numgen random mod 100 < {f.percent} drop" if random else "drop"
    return [f"{match} {verdict}"]


def nft_rules(f: NetFault, addr: dict[int, str]) -> list[str]:
    """The nftables rules (``bridge`` family, forward hook) that make ``f`` between hosts
    whose addresses ``addr`` gives; delay has none (it is a forwarder)."""
    if f.kind == "delay":
        return []
    for host in (f.src, f.dst):
        if host not in addr:
            raise NetSpecError(f"network fault {f.render()!r}: no host {host} in this lab")
    a, b = addr[f.src], addr[f.dst]
    rules = _one_way(f, a, b, reverse=False)
    if f.port is not None:
        rules += _one_way(f, b, a, reverse=True)  # the connection's replies
        if f.both:
            rules += _one_way(f, b, a, reverse=False) + _one_way(f, a, b, reverse=True)
    elif f.both:
        rules += _one_way(f, b, a, reverse=False)
    return rules
