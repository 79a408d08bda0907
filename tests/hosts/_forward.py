"""The delay fault: a userspace forwarder (``_delay_proxy.py``) in the sending host, and
a NAT rule there that redirects the host's connections to the delayed port through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from _load import scaled

from ._net import NetFault

if TYPE_CHECKING:
    from ._lab import Lab

__all__ = ["Forwarder"]

_PROXY = Path(__file__).with_name("_delay_proxy.py")
_MARK = 0x5D
_BASE_PORT = 39100


class Forwarder:
    """One delay fault: :meth:`start` redirects, :meth:`stop` (idempotent) heals."""

    def __init__(self, lab: Lab, fault: NetFault, slot: int) -> None:
        assert fault.kind == "delay" and fault.port is not None
        self.lab, self.fault, self.slot = lab, fault, slot
        self.table = f"stwd{slot}"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        f, lab = self.fault, self.lab
        src, dst = lab.hosts[f.src], lab.hosts[f.dst]
        listen = _BASE_PORT + self.slot
        argv = [sys.executable, str(_PROXY), src.addr, str(listen), dst.addr, str(f.port)]
        argv += [str(f.delay_ms), "1" if f.both else "0", str(_MARK)]
        self.proc = lab.popen(f.src, argv, cwd="/", stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"the delay forwarder for {f.render()!r} did not start")
        nft = lab.cmd(f.src, ["nft"])
        rule = (
            f"add rule ip {self.table} out ip daddr {dst.addr} tcp dport {f.port} "
            f"meta mark != {_MARK} dnat to {src.addr}:{listen}"
        )
        for line in (
            f"add table ip {self.table}",
            f"add chain ip {self.table} out {{ type nat hook output priority -100; }}",
            rule,
        ):
            subprocess.run([*nft, line], check=True, capture_output=True, timeout=scaled(30))

    def stop(self) -> None:
        if self.proc is None:
            return
        nft = self.lab.cmd(self.fault.src, ["nft"])
        subprocess.run(
            [*nft, f"delete table ip {self.table}"], capture_output=True, timeout=scaled(30)
        )
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=scaled(10))
        self.proc = None
