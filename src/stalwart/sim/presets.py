"""Named scenarios with their sources: ``llama3-54d``, ``meta-rsc1``, ``meta-rsc2``.

llama3-54d
    Llama 3 405B pre-training snapshot: 16,384 H100 GPUs (2,048 nodes x 8), 54 days, 419
    unexpected interruptions by cause (A. Grattafiori et al., "The Llama 3 Herd of Models",
    arXiv 2407.21783, Table 5); the 47 planned interruptions (firmware and configuration updates)
    are not failures and are left out. The paper reports "higher than 90% effective training time"
    and says job startup and checkpointing time were reduced, without figures. Assumed costs:

    * checkpoint: 405B parameters x 14 bytes (bf16 weights, fp32 master weights and two Adam
      moments) = 5.7 TB; the paper's Tectonic storage sustains 2 TB/s (7 TB/s peak), so ~3 s of
      I/O; we assume a 10 s synchronous save stall;
    * restart: 30 s crash detection (process exit), 300 s hang detection (collective watchdog),
      240 s relaunch with NCCL initialisation at 16k ranks, 60 s load, and 120 s to swap a failed
      node for a hot spare (256 spare nodes, 3-day mean repair).

    Rates are per GPU-hour: count / (16,384 GPUs x 1,296 h). Domains follow the cause: GPU and
    host faults take one node, network switch/cable faults take a 16-node switch; software bugs,
    NCCL watchdog timeouts and dependency failures are cured by a restart, the rest need the node
    replaced.

meta-rsc1, meta-rsc2
    Node failure rates of Meta's research clusters: 6.50 (RSC-1, 16k A100) and 2.34 (RSC-2, 8k
    A100) failures per 1,000 node-days (A. Kokolis et al., "Revisiting Reliability in Large-Scale
    ML Research Clusters", arXiv 2410.21680). The paper reports rates, not a cause breakdown: every
    failure is modelled as one node that must be replaced, detected as a crash. The job is 16,384
    GPUs (2,048 nodes x 8) for 54 days, so the three presets compare at equal scale; recovery costs
    are the library defaults (:class:`stalwart.sim.job.RecoveryCosts`).

Every preset carries the control plane's measured curve (:data:`stalwart.sim.controlplane.MEASURED`,
bench/scale.py): each recovery also waits the time from a node's loss to every survivor's
agreement at the scenario's own node count (2,048 nodes here, 16,384 at 131k GPUs), linear in N
past the largest measured N (extrapolated; ``stalwart plan`` says so).
"""

from __future__ import annotations

from stalwart.errors import ConfigError
from stalwart.sim.controlplane import MEASURED
from stalwart.sim.engine import Scenario
from stalwart.sim.failures import ClusterConfig, FailureCause, FailureModel, FaultDomain, FaultKind
from stalwart.sim.job import JobConfig, RecoveryCosts

__all__ = ["LLAMA3_CAUSES", "PRESETS", "preset"]

_LLAMA3_GPU_HOURS = 16_384 * 54 * 24.0

# (cause, interruptions in 54 days, fault domain, node must be replaced, how it shows)
LLAMA3_CAUSES: tuple[tuple[str, int, FaultDomain, bool, FaultKind], ...] = (
    ("faulty GPU", 148, "gpu", True, "crash"),
    ("GPU HBM3 memory", 72, "gpu", True, "crash"),
    ("software bug", 54, "gpu", False, "crash"),
    ("network switch/cable", 35, "switch", True, "hang"),
    ("host maintenance", 32, "node", True, "crash"),
    ("GPU SRAM memory", 19, "gpu", True, "crash"),
    ("GPU system processor", 17, "gpu", True, "crash"),
    ("NIC", 7, "node", True, "hang"),
    ("NCCL watchdog timeouts", 7, "node", False, "hang"),
    ("silent data corruption", 6, "gpu", True, "hang"),
    ("GPU thermal interface and sensor", 6, "gpu", True, "crash"),
    ("SSD", 3, "node", True, "crash"),
    ("power supply", 3, "node", True, "crash"),
    ("server chassis", 2, "node", True, "crash"),
    ("IO expansion board", 2, "node", True, "crash"),
    ("dependency", 2, "node", False, "crash"),
    ("CPU", 2, "node", True, "crash"),
    ("system memory", 2, "node", True, "crash"),
)

_LLAMA3_SOURCE = "Llama 3 (arXiv 2407.21783), Table 5: 419 unexpected interruptions in 54 days"
_RSC_SOURCE = "Kokolis et al. (arXiv 2410.21680): {rate} failures per 1,000 node-days ({name})"


def _llama3() -> Scenario:
    causes = tuple(
        FailureCause(name, count / _LLAMA3_GPU_HOURS, "gpu-hour", domain, replace, kind)
        for name, count, domain, replace, kind in LLAMA3_CAUSES
    )
    return Scenario(
        name="llama3-54d",
        cluster=ClusterConfig(nodes=2048, gpus_per_node=8, spare_nodes=256, nodes_per_switch=16),
        failures=FailureModel(causes),
        job=JobConfig(sync_save_s=10.0, snapshot_stall_s=1.0, persist_s=30.0),
        costs=RecoveryCosts(
            detect_crash_s=30.0,
            detect_hang_s=300.0,
            restart_s=240.0,
            restore_remote_s=60.0,
            node_replace_s=120.0,
        ),
        source=_LLAMA3_SOURCE,
        control_plane=MEASURED,
    )


def _rsc(name: str, rate_per_1000_node_days: float, label: str) -> Scenario:
    cause = FailureCause(
        "node failure (all causes)", rate_per_1000_node_days / 1000.0, "node-day", "node"
    )
    return Scenario(
        name=name,
        cluster=ClusterConfig(nodes=2048, gpus_per_node=8, spare_nodes=256),
        failures=FailureModel((cause,)),
        source=_RSC_SOURCE.format(rate=rate_per_1000_node_days, name=label),
        control_plane=MEASURED,
    )


PRESETS: tuple[str, ...] = ("llama3-54d", "meta-rsc1", "meta-rsc2")


def preset(name: str) -> Scenario:
    """The named scenario; ``ConfigError`` naming the known presets otherwise."""
    if name == "llama3-54d":
        return _llama3()
    if name == "meta-rsc1":
        return _rsc(name, 6.50, "RSC-1")
    if name == "meta-rsc2":
        return _rsc(name, 2.34, "RSC-2")
    raise ConfigError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
