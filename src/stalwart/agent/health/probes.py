"""Node health probes: what a node checks about itself before its hardware fails a job.

A crash or a hang is seen after it happened; hardware usually degrades first (host
memory running out, a full ``/dev/shm`` that the next snapshot would die in, a
checkpoint disk that is full or has slowed to a crawl, a GPU logging ECC errors, XIDs or
running hot). Each :class:`Probe` reads one of these and returns a
:class:`ProbeResult`; the agent runs the node's probes on a thread every
``--probe-interval`` seconds (agent/health/_node.py ``ProbeWatch``) and acts on a
failure by the ``--on-probe`` policy: ``isolate`` blocklists the node and moves its
ranks to a healthy node before the fault takes the job down, ``report`` writes the
events only. A probe that cannot run here (no ``pynvml``, no GPU) is *skipped* and says
why once, so a report shows what was not watched.

The built-ins: :class:`HostMemory`, :class:`ShmSpace`, :class:`DiskSpace`,
:class:`DiskWriteSpeed` and :class:`NvmlHealth`; :func:`build_probes` binds the ones
``--probes`` names to this node's paths.

The NVML probe reads ECC errors, XID events, temperature and clock slowdowns per GPU.
Why these four: an uncorrectable (volatile) ECC error means the GPU's memory returned
wrong data since the driver loaded; a critical XID (a GPU-side fault the driver
logged: 48 double-bit ECC, 79 fallen off the bus, 94/95 contained/uncontained ECC,
...) usually precedes a hang or a crash; a GPU running hotter than its limit, or
slowed by its hardware (thermal or power brake), turns its rank into a straggler. Each
is read through ``pynvml`` (the ``nvidia-ml-py`` package: ``pip install
stalwart[nvml]``); without it, or without a GPU, the probe is skipped and says so once,
on the console only where a GPU device exists (``/dev/nvidia<N>``): a machine without
GPUs gets the event and a debug line, not a line on every run.
"""

from __future__ import annotations

import glob
import importlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

__all__ = [
    "ON_PROBE",
    "PROBE_NAMES",
    "DiskSpace",
    "DiskWriteSpeed",
    "HostMemory",
    "NvmlHealth",
    "Probe",
    "ProbeConfig",
    "ProbeResult",
    "ShmSpace",
    "build_probes",
    "parse_probe_limits",
    "parse_probe_names",
    "slot_growth",
]

ON_PROBE = ("isolate", "report")
"""What ``--on-probe`` accepts."""
PROBE_NAMES = ("host", "shm", "disk", "nvml")
"""What ``--probes`` accepts (``disk`` is the checkpoint disk's space and write speed)."""

_MIB = 1024 * 1024


@dataclass(frozen=True)
class ProbeResult:
    """One reading of one probe. ``detail`` names the problem and the fix when it
    failed, why it was skipped when skipped, and the reading otherwise."""

    probe: str
    ok: bool
    detail: str
    value: float | None = None  # the reading, in ``unit``
    limit: float | None = None  # the bound it was checked against
    unit: str = ""
    skipped: bool = False  # could not run here: neither ok nor failed
    device: int | None = None  # the GPU index (nvml), else None: the node
    quiet: bool = False
    """A skip that says nothing on the console (its event is still written): a GPU
    probe on a machine with no GPU at all has nothing to report on every run."""


class Probe(Protocol):
    """A node health check: cheap enough to run every few seconds (or it rate-limits
    itself, like :class:`DiskWriteSpeed`), never raising (a failure is a result)."""

    name: str

    def check(self) -> list[ProbeResult]:
        """The probe's readings now (one per device for per-device probes)."""
        ...


@dataclass(frozen=True)
class ProbeConfig:
    """The bounds the built-in probes check against (``stalwart run --probe-*``)."""

    names: tuple[str, ...] = PROBE_NAMES
    """Which probes run (``--probes``): every built-in by default; ``nvml`` skips itself
    without pynvml or a GPU."""
    interval_s: float = 10.0
    """Seconds between probe rounds: a full /dev/shm or disk builds up over minutes, and
    a round costs a few statvfs calls (the write-speed probe runs every
    ``write_every_s``)."""
    host_min_available: float = 0.05
    """Fraction of host memory that must stay available (MemAvailable): below it the
    kernel's OOM killer is about to pick a worker."""
    shm_reserve_bytes: int = 64 * _MIB
    """Free /dev/shm kept beyond what the next snapshots need (progress boards, step
    journals, the persister's scratch)."""
    disk_min_free_bytes: int = 1024 * _MIB
    """Free space the checkpoint disk must keep: below it the next persist fails."""
    disk_min_mb_s: float = 2.0
    """Slowest acceptable checkpoint-disk write speed (write + fsync of
    ``write_probe_bytes``): a disk this slow makes every persist a stall. Low by
    default: a shared disk under load measures 10-50x below its quiet speed, and only a
    disk that is failing, not a busy one, should take a node out."""
    write_probe_bytes: int = 8 * _MIB
    """Bytes the write-speed probe writes (small: it must not disturb the job)."""
    write_every_s: float = 300.0
    """Seconds between write-speed probes (each writes ``write_probe_bytes``)."""
    gpu_max_temp_c: float = 90.0
    """Hottest acceptable GPU temperature (degrees C): above it the GPU throttles."""
    on_failure: str = "isolate"
    """What a failing probe does (--on-probe): ``isolate`` blocklists this node and moves
    its ranks to a healthy node before the fault takes the job down; ``report`` only
    writes the events (a node that cannot leave, node 0 hosting the store or the only
    node, always reports)."""

    def __post_init__(self) -> None:
        from stalwart.errors import ConfigError

        unknown = [n for n in self.names if n not in PROBE_NAMES]
        if unknown:
            raise ConfigError(f"--probes {unknown}: use some of {', '.join(PROBE_NAMES)}")
        if self.on_failure not in ON_PROBE:
            raise ConfigError(f"--on-probe {self.on_failure!r}: use {' or '.join(ON_PROBE)}")
        if self.interval_s <= 0 or self.write_every_s <= 0:
            raise ConfigError("--probe-interval must be > 0 seconds")
        if not 0 <= self.host_min_available < 1:
            raise ConfigError("host_min_available must be a fraction in [0, 1)")
        if min(self.shm_reserve_bytes, self.disk_min_free_bytes, self.write_probe_bytes) < 0:
            raise ConfigError("probe byte limits must be >= 0")


def parse_probe_names(text: str) -> tuple[str, ...]:
    """``--probes``: ``all``, ``none`` or a comma list of :data:`PROBE_NAMES`."""
    from stalwart.errors import ConfigError

    if text == "all":
        return PROBE_NAMES
    if text in ("none", ""):
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in PROBE_NAMES]
    if bad:
        raise ConfigError(
            f"--probes {text!r}: unknown {bad}; use all, none or some of {','.join(PROBE_NAMES)}"
        )
    return names


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class HostMemory:
    """MemAvailable / MemTotal from ``/proc/meminfo`` against ``min_available``."""

    name = "host"

    def __init__(self, min_available: float, meminfo: str = "/proc/meminfo") -> None:
        self._min, self._path = min_available, meminfo

    def check(self) -> list[ProbeResult]:
        try:
            with open(self._path) as f:
                fields = {k: v.split()[0] for k, _, v in (ln.partition(":") for ln in f) if v}
            total, avail = int(fields["MemTotal"]), int(fields["MemAvailable"])
        except (OSError, KeyError, ValueError, IndexError) as err:
            return [ProbeResult(self.name, True, f"{self._path} unreadable: {err}", skipped=True)]
        frac = avail / total if total > 0 else 0.0
        ok = frac >= self._min
        detail = f"{avail // 1024} MiB of {total // 1024} MiB host memory available"
        if not ok:
            detail += (
                f", under {self._min:.0%}: a worker is about to be OOM-killed; stop what "
                "else runs on this node or lower the job's memory use"
            )
        return [ProbeResult(self.name, ok, detail, frac, self._min, "fraction")]


class ShmSpace:
    """Free ``/dev/shm`` against what this node's next snapshots still need.

    ``pending`` says how many bytes the node's snapshot slots will still allocate (a slot
    grows to the snapshot's size the first time it is written: see :func:`slot_growth`);
    the workers refuse a snapshot that does not fit before it starts
    (checkpoint/snapshot.py), and this probe reports the node before that happens."""

    name = "shm"

    def __init__(self, reserve: int, pending: Callable[[], int], path: str = "/dev/shm") -> None:
        self._reserve, self._pending, self._path = reserve, pending, path

    def check(self) -> list[ProbeResult]:
        try:
            free = _free_bytes(self._path)
        except OSError as err:
            return [ProbeResult(self.name, True, f"{self._path}: {err}", skipped=True)]
        need = self._pending() + self._reserve
        ok = free >= need
        detail = f"{free // _MIB} MiB free in {self._path}, {need // _MIB} MiB needed"
        if not ok:
            detail += (
                " (the next snapshots' slots plus a reserve): a snapshot would be refused; "
                f"free {self._path} (stale stalwart-* files) or enlarge it "
                f"(mount -o remount,size=... {self._path})"
            )
        return [ProbeResult(self.name, ok, detail, float(free), float(need), "bytes")]


def slot_growth(directories: Iterable[str]) -> int:
    """Bytes the snapshot slots in ``directories`` will still allocate: every slot grows
    to the size of the largest one (the snapshot's size), and pages not yet allocated
    (a sparse or short file) count as needed."""
    total = 0
    for d in directories:
        sizes: list[tuple[int, int]] = []  # (apparent size, allocated bytes)
        try:
            names = [n for n in os.listdir(d) if n.startswith("slot") and n.endswith(".data")]
            for n in names:
                st = os.stat(os.path.join(d, n), follow_symlinks=False)
                sizes.append((st.st_size, st.st_blocks * 512))
        except OSError:
            continue
        if not sizes:
            continue
        want = max(s for s, _ in sizes)
        slots = max(len(sizes), 2)  # double-buffered: the second slot may not exist yet
        have = sum(min(a, want) for _, a in sizes)
        total += max(0, want * slots - have)
    return total


class DiskSpace:
    """Free space on the checkpoint disk against ``min_free``."""

    name = "disk"

    def __init__(self, path: str, min_free: int) -> None:
        self._path, self._min = path, min_free

    def check(self) -> list[ProbeResult]:
        try:
            free = _free_bytes(_existing(self._path))
        except OSError as err:
            return [ProbeResult(self.name, True, f"{self._path}: {err}", skipped=True)]
        ok = free >= self._min
        detail = f"{free // _MIB} MiB free on the checkpoint disk ({self._path})"
        if not ok:
            detail += (
                f", under {self._min // _MIB} MiB: the next persist would fail; free space "
                "or lower --keep-last"
            )
        return [ProbeResult(self.name, ok, detail, float(free), float(self._min), "bytes")]


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent (the checkpoint directory may not exist
    before the first persist)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


class DiskWriteSpeed:
    """Write + fsync ``nbytes`` into the checkpoint directory, at most every
    ``every_s`` seconds; the speed against ``min_mb_s``."""

    name = "disk_write"

    def __init__(
        self,
        path: str,
        *,
        nbytes: int,
        min_mb_s: float,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path, self._n, self._min, self._every = path, nbytes, min_mb_s, every_s
        self._clock = clock
        self._last: float | None = None

    def check(self) -> list[ProbeResult]:
        now = self._clock()
        if self._last is not None and now - self._last < self._every:
            return []
        self._last = now
        directory = _existing(self._path)
        target = os.path.join(directory, f".stalwart-write-probe-{os.getpid()}")
        try:
            t0 = time.perf_counter()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                block = b"\0" * min(self._n, _MIB)
                left = self._n
                while left > 0:
                    left -= os.write(fd, block[:left])
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(target)
            seconds = time.perf_counter() - t0
        except OSError as err:
            why = f"cannot write to {directory}: {err}; the next persist would fail too"
            return [ProbeResult(self.name, False, why, 0.0, self._min, "MB/s")]
        mb_s = self._n / 1e6 / max(seconds, 1e-9)
        ok = mb_s >= self._min
        detail = f"{mb_s:.0f} MB/s write + fsync into {directory}"
        if not ok:
            detail += (
                f", under {self._min:.0f} MB/s: every persist would stall; check the disk "
                "(dmesg) or move --run-dir to a faster one"
            )
        return [ProbeResult(self.name, ok, detail, mb_s, self._min, "MB/s")]


_LIMITS = {  # --probe-limits key -> (ProbeConfig field, scale to the field's unit)
    "host_min_available": ("host_min_available", 1.0),
    "shm_reserve_mb": ("shm_reserve_bytes", float(_MIB)),
    "disk_min_free_mb": ("disk_min_free_bytes", float(_MIB)),
    "disk_min_mb_s": ("disk_min_mb_s", 1.0),
    "write_every_s": ("write_every_s", 1.0),
    "gpu_max_temp_c": ("gpu_max_temp_c", 1.0),
}


def parse_probe_limits(
    text: str | None, *, names: tuple[str, ...], interval_s: float, on_failure: str = "isolate"
) -> ProbeConfig:
    """``--probe-limits K=V,...`` (keys: :data:`_LIMITS`) over the defaults."""
    from stalwart.errors import ConfigError

    d = ProbeConfig()
    v: dict[str, float] = {
        "host_min_available": d.host_min_available,
        "shm_reserve_bytes": d.shm_reserve_bytes,
        "disk_min_free_bytes": d.disk_min_free_bytes,
        "disk_min_mb_s": d.disk_min_mb_s,
        "write_every_s": d.write_every_s,
        "gpu_max_temp_c": d.gpu_max_temp_c,
    }
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.strip().partition("=")
        if key not in _LIMITS:
            raise ConfigError(
                f"--probe-limits {part!r}: unknown key; use some of {', '.join(_LIMITS)}"
            )
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"--probe-limits {part!r}: {key} needs a number") from None
        if not 0 <= number < float("inf"):
            raise ConfigError(f"--probe-limits {part!r}: use a finite number >= 0")
        name, scale = _LIMITS[key]
        v[name] = number * scale
    return ProbeConfig(
        names=names,
        interval_s=interval_s,
        host_min_available=v["host_min_available"],
        shm_reserve_bytes=int(v["shm_reserve_bytes"]),
        disk_min_free_bytes=int(v["disk_min_free_bytes"]),
        disk_min_mb_s=v["disk_min_mb_s"],
        write_every_s=v["write_every_s"],
        gpu_max_temp_c=v["gpu_max_temp_c"],
        on_failure=on_failure,
    )


_SLOWDOWN_BITS = (
    ("nvmlClocksThrottleReasonHwSlowdown", "hardware slowdown"),
    ("nvmlClocksThrottleReasonHwThermalSlowdown", "hardware thermal slowdown"),
    ("nvmlClocksThrottleReasonSwThermalSlowdown", "software thermal slowdown"),
    ("nvmlClocksThrottleReasonHwPowerBrakeSlowdown", "power brake"),
)


class NvmlHealth:
    """One result per GPU per round; ``nvml``: the module (a fake in tests)."""

    name = "nvml"

    def __init__(self, *, max_temp_c: float, nvml: ModuleType | None = None) -> None:
        self._max_temp = max_temp_c
        self._nv: Any = nvml  # pynvml is untyped: every attribute is Any anyway
        self._skip: str | None = None
        self._quiet = False  # skipped where there is no GPU at all: nothing to say
        self._handles: list[Any] = []
        self._events: Any = None
        self._xids: dict[int, list[int]] = {}

    def _open(self) -> bool:
        if self._handles:
            return True
        if self._skip is not None:
            return False
        try:
            if self._nv is None:
                self._nv = importlib.import_module("pynvml")
            nv = self._nv
            nv.nvmlInit()
            self._handles = [
                nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())
            ]
        except ImportError:
            self._skip = "pynvml is not installed (pip install stalwart[nvml]): GPUs not probed"
            self._quiet = not _gpu_devices()
            return False
        except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._skip = f"NVML unavailable ({err}): no GPU or no driver here, GPUs not probed"
            self._quiet = not _gpu_devices()
            return False
        if not self._handles:
            self._skip = "NVML sees no GPU: GPUs not probed"
            return False
        self._register_xids()
        return True

    def _register_xids(self) -> None:
        nv = self._nv
        try:
            self._events = nv.nvmlEventSetCreate()
            for h in self._handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
        except Exception:
            self._events = None  # not supported here (some VMs, MIG): ECC/temp still read

    def check(self) -> list[ProbeResult]:
        if not self._open():
            skip = str(self._skip)
            return [ProbeResult(self.name, True, skip, skipped=True, quiet=self._quiet)]
        self._drain_xids()
        return [self._device(i, h) for i, h in enumerate(self._handles)]

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        nv, index = self._nv, {id(h): i for i, h in enumerate(self._handles)}
        for _ in range(64):  # what arrived since the last round, bounded
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except Exception:  # NVMLError_Timeout: nothing more
                return
            dev = index.get(id(data.device), 0)
            self._xids.setdefault(dev, []).append(int(data.eventData))

    def _device(self, i: int, h: Any) -> ProbeResult:
        nv, problems = self._nv, []
        try:
            temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        except Exception:
            temp = float("nan")
        if temp > self._max_temp:
            problems.append(f"{temp:.0f} C, over {self._max_temp:.0f} C")
        try:
            ecc = int(
                nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                )
            )
        except Exception:
            ecc = 0  # ECC off or not supported: nothing to count
        if ecc > 0:
            problems.append(f"{ecc} uncorrectable ECC errors")
        if xids := self._xids.pop(i, []):
            problems.append(f"XID {', '.join(str(x) for x in sorted(set(xids)))}")
        problems += self._slowdowns(h)
        detail = f"GPU {i}: {temp:.0f} C, {ecc} uncorrectable ECC errors"
        if problems:
            detail = (
                f"GPU {i}: {'; '.join(problems)}: it is failing or slowing its rank; "
                "drain the node and check it (nvidia-smi -q, dmesg)"
            )
        return ProbeResult(self.name, not problems, detail, temp, self._max_temp, "C", device=i)

    def _slowdowns(self, h: Any) -> list[str]:
        nv = self._nv
        try:
            reasons = int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        except Exception:
            return []
        return [
            what
            for attr, what in _SLOWDOWN_BITS
            if (bit := getattr(nv, attr, None)) is not None and reasons & int(bit)
        ]


def _gpu_devices() -> list[str]:
    """The NVIDIA device files of this machine (none: it has no GPU to probe)."""
    return glob.glob("/dev/nvidia[0-9]*")


def build_probes(cfg: ProbeConfig, *, ckpt_dir: str, shm_pending: Callable[[], int]) -> list[Probe]:
    """The probes ``cfg.names`` asks for, bound to this node's paths."""
    out: list[Probe] = []
    if "host" in cfg.names:
        out.append(HostMemory(cfg.host_min_available))
    if "shm" in cfg.names:
        out.append(ShmSpace(cfg.shm_reserve_bytes, shm_pending))
    if "disk" in cfg.names:
        out.append(DiskSpace(ckpt_dir, cfg.disk_min_free_bytes))
        out.append(
            DiskWriteSpeed(
                ckpt_dir,
                nbytes=cfg.write_probe_bytes,
                min_mb_s=cfg.disk_min_mb_s,
                every_s=cfg.write_every_s,
            )
        )
    if "nvml" in cfg.names:
        out.append(NvmlHealth(max_temp_c=cfg.gpu_max_temp_c))
    return out
