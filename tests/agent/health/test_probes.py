"""The health probes (agent/health/probes.py, agent/health/probes.py) and their detector
(agent/health/_node.py), in-process with fakes."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.agent.health._node import ProbeWatch
from stalwart.agent.health.probes import (
    DiskSpace,
    DiskWriteSpeed,
    HostMemory,
    NvmlHealth,
    ProbeConfig,
    ProbeResult,
    ShmSpace,
    build_probes,
    parse_probe_names,
    slot_growth,
)
from stalwart.errors import ConfigError
from stalwart.metrics.events import EventLog, read_events


def _meminfo(tmp_path: Path, total_kb: int, avail_kb: int) -> str:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: {total_kb} kB\nMemFree: 1 kB\nMemAvailable: {avail_kb} kB\n")
    return str(p)


def test_host_memory_fails_below_the_fraction(tmp_path: Path) -> None:
    (ok,) = HostMemory(0.05, _meminfo(tmp_path, 1000_000, 100_000)).check()
    assert ok.ok and ok.value == pytest.approx(0.1)
    (low,) = HostMemory(0.05, _meminfo(tmp_path, 1000_000, 10_000)).check()
    assert not low.ok and "OOM" in low.detail


def test_host_memory_unreadable_is_skipped(tmp_path: Path) -> None:
    (r,) = HostMemory(0.05, str(tmp_path / "missing")).check()
    assert r.skipped and r.ok


def test_shm_space_counts_what_the_slots_still_need(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    (ok,) = ShmSpace(0, lambda: 0, str(tmp_path)).check()
    assert ok.ok
    (full,) = ShmSpace(0, lambda: free * 2, str(tmp_path)).check()
    assert not full.ok and "refused" in full.detail and "remount" in full.detail


def test_slot_growth_is_the_second_slot_until_it_is_written(tmp_path: Path) -> None:
    d = tmp_path / "stalwart-job-rank0"
    d.mkdir()
    with open(d / "slot0.data", "wb") as f:
        f.write(b"\1" * 65536)  # allocated
    assert slot_growth([str(d)]) == 65536  # slot1 will need as much
    with open(d / "slot1.data", "wb") as f:
        f.truncate(65536)  # sparse: nothing allocated yet
    assert slot_growth([str(d)]) >= 65536 - 4096
    with open(d / "slot1.data", "wb") as f:
        f.write(b"\1" * 65536)
    assert slot_growth([str(d), str(tmp_path / "absent")]) == 0


def test_disk_space_and_a_missing_checkpoint_dir(tmp_path: Path) -> None:
    (ok,) = DiskSpace(str(tmp_path / "ckpt" / "not-yet"), 0).check()
    assert ok.ok and not ok.skipped
    (full,) = DiskSpace(str(tmp_path), 1 << 62).check()
    assert not full.ok and "--keep-last" in full.detail


def test_write_speed_rate_limits_itself(tmp_path: Path) -> None:
    now = [0.0]
    probe = DiskWriteSpeed(
        str(tmp_path), nbytes=1 << 16, min_mb_s=0.0, every_s=60.0, clock=lambda: now[0]
    )
    (r,) = probe.check()
    assert r.ok and r.value is not None and r.value > 0 and r.unit == "MB/s"
    assert probe.check() == []  # not again within every_s
    now[0] = 61.0
    assert len(probe.check()) == 1
    assert not [p for p in os.listdir(tmp_path) if "write-probe" in p]  # cleaned up
    slow = DiskWriteSpeed(str(tmp_path), nbytes=1 << 16, min_mb_s=1e12, every_s=1.0)
    (bad,) = slow.check()
    assert not bad.ok and "--run-dir" in bad.detail


def test_write_speed_unwritable_dir_fails(tmp_path: Path) -> None:
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    probe = DiskWriteSpeed(str(target / "ckpt"), nbytes=4096, min_mb_s=0.0, every_s=1.0)
    (r,) = probe.check()
    assert not r.ok and "cannot write" in r.detail


class _FakeNvml:
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8
    nvmlClocksThrottleReasonHwSlowdown = 0x8
    nvmlClocksThrottleReasonHwThermalSlowdown = 0x40

    def __init__(self, temps: list[float], ecc: list[int]) -> None:
        self.temps, self.ecc, self.reasons = temps, ecc, [0] * len(temps)
        self.handles = [SimpleNamespace(i=i) for i in range(len(temps))]
        self.xids: list[Any] = []

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return self.handles[i]

    def nvmlDeviceGetTemperature(self, h: Any, _kind: int) -> float:
        return self.temps[h.i]

    def nvmlDeviceGetTotalEccErrors(self, h: Any, _t: int, _c: int) -> int:
        return self.ecc[h.i]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any) -> int:
        return self.reasons[h.i]

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: Any, kind: int, events: object) -> None: ...
    def nvmlEventSetWait(self, events: object, timeout_ms: int) -> Any:
        if not self.xids:
            raise RuntimeError("NVMLError_Timeout")
        return self.xids.pop(0)


def test_nvml_reports_ecc_xid_heat_and_slowdown() -> None:
    nv = _FakeNvml([50.0, 50.0], [0, 0])
    probe = NvmlHealth(max_temp_c=90.0, nvml=nv)  # type: ignore[arg-type]
    assert all(r.ok and not r.skipped for r in probe.check())
    nv.ecc[1], nv.temps[0] = 2, 95.0
    nv.xids.append(SimpleNamespace(device=nv.handles[1], eventData=79))
    nv.reasons[0] = 0x40
    hot, bad = probe.check()
    assert not hot.ok and hot.device == 0 and "95 C" in hot.detail and "thermal" in hot.detail
    assert not bad.ok and bad.device == 1 and "2 uncorrectable ECC" in bad.detail
    assert "XID 79" in bad.detail


def test_nvml_without_pynvml_or_gpu_is_skipped_with_a_note() -> None:
    class NoGpu(_FakeNvml):
        def nvmlInit(self) -> None:
            raise RuntimeError("NVMLError_LibraryNotFound")

    (r,) = NvmlHealth(max_temp_c=90.0, nvml=NoGpu([], [])).check()  # type: ignore[arg-type]
    assert r.skipped and r.ok and "not probed" in r.detail
    (none,) = NvmlHealth(max_temp_c=90.0, nvml=_FakeNvml([], [])).check()  # type: ignore[arg-type]
    assert none.skipped and "no GPU" in none.detail


def test_the_gpu_probe_says_nothing_on_a_machine_without_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without pynvml: a line on the console only where a GPU device exists
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: not installed
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    (r,) = NvmlHealth(max_temp_c=90.0).check()
    assert r.skipped and r.quiet and "pynvml is not installed" in r.detail
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    (loud,) = NvmlHealth(max_temp_c=90.0).check()
    assert loud.skipped and not loud.quiet  # a GPU it cannot probe: worth saying


def test_probe_names_and_config() -> None:
    assert parse_probe_names("all") == ("host", "shm", "disk", "nvml")
    assert parse_probe_names("none") == ()
    assert parse_probe_names("shm,disk") == ("shm", "disk")
    with pytest.raises(ConfigError, match="unknown"):
        parse_probe_names("shm,gpu")
    with pytest.raises(ConfigError, match="probe-interval"):
        ProbeConfig(interval_s=0)


def test_build_probes_binds_paths(tmp_path: Path) -> None:
    probes = build_probes(ProbeConfig(), ckpt_dir=str(tmp_path), shm_pending=lambda: 0)
    assert [p.name for p in probes] == ["host", "shm", "disk", "disk_write", "nvml"]
    assert build_probes(ProbeConfig(names=()), ckpt_dir="x", shm_pending=lambda: 0) == []


class _Flaky:
    name = "shm"

    def __init__(self) -> None:
        self.ok = [True, False, False, True]

    def check(self) -> list[ProbeResult]:
        return [ProbeResult(self.name, self.ok.pop(0), "reading")]


class _Raises:
    name = "boom"

    def check(self) -> list[ProbeResult]:
        raise ValueError("broken probe")


def test_watch_reports_first_reading_then_changes(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path / "events.jsonl"), node=1)
    said: list[str] = []
    watch = ProbeWatch([_Flaky(), _Raises()], interval_s=1.0, node=1, events=log, say=said.append)
    found = []
    for _ in range(4):
        watch.round()
        found += watch.failures()
    log.close()
    assert [(f.node, f.probe) for f in found] == [(1, "shm")]  # once, at the change
    events = read_events(str(tmp_path / "events.jsonl")).events
    probes = [(e["probe"], e["ok"], e["skipped"]) for e in events if e.kind == "probe"]
    assert probes == [("shm", True, False), ("boom", True, True), ("shm", False, False),
                      ("shm", True, False)]  # fmt: skip
    detected = [e for e in events if e.kind == "fault_detected"]
    assert [e["fault"] for e in detected] == ["probe_shm"]
    assert detected[0]["domain"]["node"] == 1
    assert any("healthy again" in s for s in said) and any("broken probe" in s for s in said)


def test_watch_thread_starts_and_stops(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path / "events.jsonl"), node=0)
    watch = ProbeWatch([_Flaky()], interval_s=0.01, node=0, events=log, say=lambda _: None)
    watch.start()
    import time

    deadline = time.monotonic() + 10
    while not watch.failures() and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    log.close()
    assert time.monotonic() < deadline


class _Cluster:
    def __init__(self) -> None:
        self.blocked: list[tuple[str, str]] = []

    def block(self, member: str, reason: str) -> None:
        self.blocked.append((member, reason))


def _cfg(tmp_path: Path, **kw: Any) -> Any:
    from stalwart.agent import LaunchConfig

    script = tmp_path / "train.py"
    script.write_text("")
    return LaunchConfig(script=str(script), **kw)


def test_isolate_blocklists_and_leaves_when_the_node_can(tmp_path: Path) -> None:
    from stalwart.agent._outcome import Cordoned
    from stalwart.agent.health._node import isolate_node

    log = EventLog(str(tmp_path / "events.jsonl"), node=1)
    cluster = _Cluster()
    cfg = _cfg(tmp_path, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(Cordoned, match="node 1 isolated: probe shm"):
        isolate_node(cfg, cluster, log, lambda _: None, "probe shm failed: full")
    assert cluster.blocked == [("node1", "probe shm failed: full")]
    log.close()
    (iso,) = [e for e in read_events(str(tmp_path / "events.jsonl")).events]
    assert iso.kind == "isolation" and iso["member"] == "node1" and iso["blocklisted"]


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({}, "the only node"),
        ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "127.0.0.1:1"}, "hosts the job's store"),
        (
            {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "127.0.0.1:1",
             "probes": ProbeConfig(on_failure="report")},
            "--on-probe report",
        ),
    ],
)  # fmt: skip
def test_a_node_that_cannot_or_must_not_leave_reports(
    tmp_path: Path, kw: dict[str, Any], why: str
) -> None:
    from stalwart.agent.health._node import isolate_node

    log = EventLog(str(tmp_path / "events.jsonl"), node=0)
    cluster = _Cluster()
    isolate_node(_cfg(tmp_path, **kw), cluster, log, lambda _: None, "probe disk failed")
    log.close()
    assert cluster.blocked == []
    (note,) = read_events(str(tmp_path / "events.jsonl")).events
    assert note.kind == "note" and why in note["message"]


def test_a_probe_failing_after_the_nodes_ranks_finished_does_not_isolate_it(
    tmp_path: Path,
) -> None:
    # the race: the probe fails once rank 2 passed the finish barrier; isolated, the node
    # would be adopted and its ranks started again, waiting for peers that had exited
    from stalwart.agent.health._node import isolate_node

    log = EventLog(str(tmp_path / "events.jsonl"), node=1)
    cluster = _Cluster()
    cfg = _cfg(tmp_path, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:1")
    isolate_node(cfg, cluster, log, lambda _: None, "probe disk failed", finished=2)
    log.close()
    assert cluster.blocked == []  # not blocklisted, no Cordoned: it ends with its ranks
    (note,) = read_events(str(tmp_path / "events.jsonl")).events
    assert note.kind == "note" and "rank 2 finished the job" in note["message"]


def test_probe_limits_parse_over_the_defaults() -> None:
    from stalwart.agent.health.probes import parse_probe_limits

    cfg = parse_probe_limits("disk_min_free_mb=10,gpu_max_temp_c=80", names=(), interval_s=5)
    assert cfg.disk_min_free_bytes == 10 * 1024 * 1024 and cfg.gpu_max_temp_c == 80
    assert cfg.shm_reserve_bytes == ProbeConfig().shm_reserve_bytes and cfg.interval_s == 5
    with pytest.raises(ConfigError, match="unknown key"):
        parse_probe_limits("disk=1", names=(), interval_s=5)
    with pytest.raises(ConfigError, match="needs a number"):
        parse_probe_limits("disk_min_mb_s=fast", names=(), interval_s=5)
    with pytest.raises(ConfigError, match="on-probe"):
        ProbeConfig(on_failure="evict")
