"""The NVML probe: ECC errors, XID events, temperature and clock slowdowns per GPU.

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
from types import ModuleType
from typing import Any

from stalwart.agent.probes import ProbeResult

__all__ = ["NvmlHealth"]

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
