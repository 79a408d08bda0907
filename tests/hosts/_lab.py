"""N hosts on one machine: network namespaces on a bridge, each with its own address,
host name and /dev/shm, and network faults between them (``_net.py``).

A host is a network namespace (``ip netns``) joined to the lab's bridge by a veth pair,
plus a holder process in it that owns the host's UTS namespace (its host name) and mount
namespace (a private tmpfs on /dev/shm, and ``/etc/hosts`` naming every host of the lab,
bind-mounted by ``ip netns exec`` from ``/etc/netns/NS/hosts``). Processes run "on" a
host by entering the holder's namespaces (``nsenter``). Everything the lab creates is
named after its tag and removed by :meth:`Lab.close`, which the tests' fixtures call
even when a test fails; a close that cannot remove something says what.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from _load import scaled

from ._forward import Forwarder
from ._net import NetFault, nft_rules, parse_net

__all__ = ["Host", "Lab", "lab_missing"]

_SHM_SIZE = "2g"


def lab_missing() -> str | None:
    """Why this machine cannot build a lab (None: it can)."""
    if os.geteuid() != 0:
        return "the multi-host tests need root (network namespaces, nftables)"
    for tool in ("ip", "nft", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} not found: install iproute2, nftables and util-linux"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(30))
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


@dataclass
class Host:
    """One host of the lab."""

    index: int
    name: str
    """Its host name (``h0``, ``h1``, ...), resolved by every host's /etc/hosts."""
    addr: str
    """Its address on the lab's bridge."""
    netns: str
    holder: subprocess.Popen[str] | None = field(default=None, repr=False)

    @property
    def shm(self) -> Path:
        """This host's /dev/shm, seen from outside (through the holder's mount namespace)."""
        assert self.holder is not None
        return Path(f"/proc/{self.holder.pid}/root/dev/shm")


class Lab:
    """``n`` hosts on a private bridge; use as a context manager or call :meth:`close`."""

    def __init__(self, n: int, *, hosts_file_extra: dict[int, str] | None = None) -> None:
        self.tag = secrets.token_hex(3)
        subnet = 16 + secrets.randbelow(200)
        self.bridge = f"sw{self.tag}b"
        self.table = f"stw_{self.tag}"
        self.hosts = [
            Host(i, f"h{i}", f"10.231.{subnet}.{i + 1}", f"stw-{self.tag}-h{i}") for i in range(n)
        ]
        self._extra = hosts_file_extra or {}
        self._faults: list[NetFault] = []
        self._forwarders: list[Forwarder] = []
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Lab:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            veth = f"sw{self.tag}{h.index}"
            _sh("ip", "netns", "add", h.netns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _sh("ip", "link", "set", f"{veth}p", "netns", h.netns)
            _sh("ip", "-n", h.netns, "link", "set", f"{veth}p", "name", "eth0")
            _sh("ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _sh("ip", "-n", h.netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            own = self._extra.get(h.index, "")
            (etc / "hosts").write_text(own + hosts_file)
            self._start_holder(h)
        _sh("nft", "add", "table", "bridge", self.table)
        _sh(
            "nft",
            f"add chain bridge {self.table} forward {{ type filter hook forward priority 0; "
            "policy accept; }",
        )

    def _start_holder(self, h: Host) -> None:
        script = (
            f"hostname {h.name} && mount -t tmpfs -o size={_SHM_SIZE} tmpfs /dev/shm "
            "&& echo ready && exec sleep 86400"
        )
        h.holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                h.netns,
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert h.holder.stdout is not None
        line = h.holder.stdout.readline()  # the holder exits (EOF) if a step failed
        if line.strip() != "ready":
            h.holder.kill()
            _, err = h.holder.communicate(timeout=scaled(10))
            raise RuntimeError(f"host {h.name} did not start: {err.strip()}")

    def cmd(self, host: int, argv: list[str], cwd: str | None = None) -> list[str]:
        """``argv`` as a command line that runs on ``host``."""
        h = self.hosts[host]
        assert h.holder is not None
        pid = str(h.holder.pid)
        wd = [f"--wd={cwd}"] if cwd else []
        return ["nsenter", "-t", pid, "--net", "--uts", "--mount", *wd, "--", *argv]

    def popen(self, host: int, argv: list[str], cwd: str, **kw: object) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` (the caller reaps it); nsenter execs, so the
        process's pid is the program's."""
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            self.cmd(host, argv, cwd), text=True, cwd=cwd, **kw
        )

    # -- faults -------------------------------------------------------------------

    def inject(self, spec: str) -> list[NetFault]:
        """Start every fault of ``spec`` now; those with ``for Ns`` heal by themselves."""
        faults = parse_net(spec)
        addr = {h.index: h.addr for h in self.hosts}
        for f in faults:
            with self._lock:
                slot = len(self._faults)
                self._faults.append(f)
            chain = f"f{slot}"
            if f.kind == "delay":
                assert f.port is not None
                fw = Forwarder(self, f, slot)
                fw.start()
                self._forwarders.append(fw)
            else:
                _sh("nft", "add", "chain", "bridge", self.table, chain)
                for rule in nft_rules(f, addr):
                    _sh("nft", f"add rule bridge {self.table} {chain} {rule}")
                # only the packets that enter this lab's own bridge ports (``sw<tag><i>``):
                # another lab running beside it may have drawn the same subnet
                jump = f'forward iifname "sw{self.tag}*" jump {chain}'
                _sh("nft", f"add rule bridge {self.table} {jump}")
            if f.duration_s is not None:
                t = threading.Timer(f.duration_s, self.heal, args=(slot,))
                t.daemon = True
                t.start()
                self._timers.append(t)
        return faults

    def heal(self, slot: int | None = None) -> None:
        """Heal one fault (its slot, in injection order) or all of them."""
        with self._lock:
            slots = range(len(self._faults)) if slot is None else [slot]
            for s in slots:
                if self._faults[s].kind == "delay":
                    for fw in self._forwarders:
                        if fw.slot == s:
                            fw.stop()
                else:
                    _sh("nft", "flush", "chain", "bridge", self.table, f"f{s}", check=False)

    # -- teardown -----------------------------------------------------------------

    def close(self) -> None:
        """Remove everything the lab made; raise naming what could not be removed."""
        for t in self._timers:
            t.cancel()
        for fw in self._forwarders:
            fw.stop()
        for h in self.hosts:
            if h.holder is not None and h.holder.poll() is None:
                h.holder.kill()
            if h.holder is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.holder.communicate(timeout=scaled(10))
        _sh("nft", "delete", "table", "bridge", self.table, check=False)
        left = []
        for h in self.hosts:
            _sh("ip", "link", "del", f"sw{self.tag}{h.index}", check=False)
            _sh("ip", "netns", "del", h.netns, check=False)
            shutil.rmtree(Path("/etc/netns") / h.netns, ignore_errors=True)
            if h.netns in _sh("ip", "netns", "list").stdout:
                left.append(f"netns {h.netns}")
        _sh("ip", "link", "del", self.bridge, check=False)
        if _sh("ip", "link", "show", self.bridge, check=False).returncode == 0:
            left.append(f"bridge {self.bridge}")
        if _sh("nft", "list", "table", "bridge", self.table, check=False).returncode == 0:
            left.append(f"nft table bridge {self.table}")
        if left:
            raise RuntimeError(f"the lab left behind: {', '.join(left)}")
