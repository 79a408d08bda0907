"""Configuration of a `stalwart run` node agent (one per node)."""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass, field

from stalwart.agent.cluster._address import parse_endpoint, resolve_node_address
from stalwart.agent.detection.degraded import DegradedConfig
from stalwart.agent.detection.hang import HangConfig
from stalwart.agent.detection.stragglers import StragglerConfig
from stalwart.agent.health.endpoint import HealthEndpointConfig
from stalwart.agent.health.probes import ProbeConfig
from stalwart.contract.env import DEFAULTS, STRATEGIES, Strategy, WorkerEnv, replica_group_size
from stalwart.errors import ConfigError

__all__ = ["STRATEGIES", "LaunchConfig", "ZygoteStart"]


@dataclass(frozen=True)
class ZygoteStart:
    """How long the node's zygote may take to answer ``ready`` (it imports torch,
    stalwart and the script's preloaded modules first). Judged by the zygote's own CPU
    time, not the clock: on a loaded machine the same imports take many times longer by
    the clock but no more CPU (a fixed 120 s wall deadline failed to start a 2-worker
    job at load 17 on 2 cores), while a stuck import uses no CPU at all."""

    cpu_s: float = 300.0
    """CPU seconds the zygote may use before ``ready`` (``--zygote-ready-cpu``). Torch
    alone costs about 2 s and a large preload (transformers, a model zoo) tens of
    seconds; past 300 s an import is looping, whatever the load."""
    stall_s: float = 120.0
    """Wall seconds the zygote may go without using any CPU before ``ready``
    (``--zygote-stall``): an import waiting on a hung file system or a lock. A
    runnable process gets CPU within a second even at a load of 10 per core, so 120 s
    of none is a stall, not a busy machine."""

    def __post_init__(self) -> None:
        if not (0 < self.cpu_s <= 86400 and 1 <= self.stall_s <= 86400):
            raise ConfigError(
                f"--zygote-ready-cpu {self.cpu_s:g} / --zygote-stall {self.stall_s:g}: use "
                "0 < CPU seconds <= 86400 and 1 <= stall seconds <= 86400"
            )


@dataclass(frozen=True)
class LaunchConfig:
    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the node-0 agent's store
    rdzv: str | None = None  # etcd://host:port/job-id: the coordinator lives in etcd
    job: str = field(default_factory=lambda: f"job-{uuid.uuid4().hex[:8]}")
    run_dir: str = ""
    max_restarts: int = 3
    """Whole-job restarts (torchrun's route: ``--strategy restart``, plain scripts, a node
    loss under restart). torchrun defaults to 0, which ends a job at its first fault."""
    crash_loop_limit: int = 3
    """A rank failing this many times in a row at the same step (or at start-up) ends the
    job with a verdict (agent/detection/verdict.py): a deterministic failure only repeats."""
    blocklist_after: int = 3
    """Failures of one member within 10 minutes that blocklist it (the coordinator's
    failure threshold): a rank that keeps failing is on sick hardware. ``stalwart
    compare`` raises it, its faults being injected on healthy ranks on purpose."""
    strategy: Strategy = DEFAULTS.strategy
    """The recovery strategy; a name (``"flash"``) is parsed into its :class:`Strategy`."""
    spares: int = 0
    chaos: str | None = None
    redirect: bool = False  # worker output to RUN_DIR/logs/rank<r>.log
    token_file: str | None = None
    hang: HangConfig = field(default_factory=HangConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """How stragglers are judged and what is done with one (``--on-straggler``)."""
    degraded: DegradedConfig = field(default_factory=DegradedConfig)
    """How a degraded link between nodes is judged (the step rate collapses while the
    ranks compute as before, agent/detection/degraded.py) and what is done with one
    (``--on-degraded``: report, or evict the node behind it)."""
    runtime: WorkerEnv = DEFAULTS
    """The runtime knobs (``contract.env.KNOBS``: `stalwart run`'s flags generated from
    the contract) as a contract, checked when built; the agent hands every worker these
    fields (``knob_values``), the rest of it is ignored."""
    metrics_port: int | None = None  # Prometheus endpoint on node 0 (0: a free port)
    metrics_host: str = "127.0.0.1"  # its bind address (0.0.0.0 in a pod, for scrapes)
    health: HealthEndpointConfig = field(default_factory=HealthEndpointConfig)
    """This node's /healthz and /readyz (--health-port, agent/health/endpoint.py)."""
    progress: bool = False  # console progress line on node 0 (stderr)
    monitor_interval_s: float = 0.02
    node_lease_s: float = 3.0
    partition_grace_s: float = 5.0
    """Seconds a silently expired node may rejoin before it is lost (agent/cluster/_grace.py)."""
    replica_rate_mb_s: float = 0.0  # peer memory replicas to a buddy node, MB/s (0: off)
    standby: bool = False  # pre-started, parked workers for the ranks this node would adopt
    # (and, under --strategy spare, for its own ranks: warm spares past the set-up)
    ckpt_tier: str | None = None
    """A bucket (``s3://bucket/prefix``) that RUN_DIR/ckpt's steps are copied to in the
    background, and that an empty or older RUN_DIR/ckpt is filled from at start (node 0;
    agent/rundir/_tier.py, docs/checkpoint-storage.md)."""
    s3_endpoint: str | None = None
    """The S3 endpoint of ``ckpt_tier`` (None: boto3's own, AWS_ENDPOINT_URL or the AWS
    config file, else AWS)."""
    tier_keep_last: int | None = None
    """Committed steps the bucket tier keeps (None: ``runtime.keep_last``, as ckpt/)."""
    tier_keep_every: int | None = None
    """Milestones the bucket tier keeps (None: ``runtime.keep_every``; 0: none)."""
    replica_host: str = ""
    """The address this node's peer watch and replica receiver bind and advertise to the
    other nodes (empty: the local address of the route to the rendezvous, 127.0.0.1 when
    that is loopback or there is none; agent/cluster/_address.py)."""
    start_timeout_s: float = 120.0
    """Seconds a node waits for the job's launch records at start (node 0's c10d
    record, the cluster's first agreement); the zygote's own start: ``zygote``."""
    zygote: ZygoteStart = field(default_factory=ZygoteStart)
    """When a starting zygote counts as failed (its CPU time, not the clock)."""
    # elastic (--nnodes/--nproc-per-node MIN:MAX): the job trains with at least
    # min_nnodes x min_nproc_per_node workers; below that it waits up to elastic_wait_s
    min_nnodes: int | None = None
    min_nproc_per_node: int | None = None
    elastic_wait_s: float = DEFAULTS.elastic_wait_s
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    """The node's health probes and their bounds (agent/health/probes.py, --probes)."""
    preflight: bool = False
    """Check every node before the first generation (--preflight, agent/health/preflight.py):
    a matmul and an allreduce with a partner; slow or failing nodes leave."""

    def tier_retention(self) -> tuple[int, int | None]:
        """The bucket tier's (keep_last, keep_every): its own flags, else ckpt/'s."""
        last = self.runtime.keep_last if self.tier_keep_last is None else self.tier_keep_last
        every = self.runtime.keep_every if self.tier_keep_every is None else self.tier_keep_every
        return last, every or None

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} (--nnodes)"
            )
        given = str.__str__(self.strategy)
        strategy = Strategy.parse(given, lambda fix: ConfigError(f"--strategy {given!r}: {fix}"))
        object.__setattr__(self, "strategy", strategy)
        self._check_strategy(strategy, given)
        if self.max_restarts < 0 or self.spares < 0:
            raise ConfigError("--max-restarts and --spares must be >= 0")
        if not 0 <= self.partition_grace_s <= 3600:
            raise ConfigError(f"--partition-grace {self.partition_grace_s}: use 0..3600 seconds")
        _check_failure_limits(self.crash_loop_limit, self.blocklist_after)
        if self.rdzv is not None:
            from stalwart.coordinator import parse_etcd_url

            target = parse_etcd_url(self.rdzv)  # ConfigError naming the problem
            if target.job_id != self.job:
                raise ConfigError(
                    f"--rdzv names job {target.job_id!r} but the job id is {self.job!r}; "
                    "drop --rdzv-id (the URL's job id is used)"
                )
            if self.rdzv_endpoint:
                raise ConfigError("--rdzv etcd://... and --rdzv-endpoint exclude each other")
        elif self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0 serves it)")
        if not os.path.isfile(self.script):
            raise ConfigError(f"training script {self.script!r} not found")
        for low, high, flag in (
            (self.min_nnodes, self.nnodes, "--nnodes"),
            (self.min_nproc_per_node, self.nproc_per_node, "--nproc-per-node"),
        ):
            # other strategies keep the world size at MAX (torchrun's flags stay accepted)
            if low is not None and not 1 <= low <= high:
                raise ConfigError(f"{flag} {low}:{high}: need 1 <= MIN <= MAX")
        if self.elastic_wait_s <= 0:
            raise ConfigError("--elastic-wait must be > 0 seconds")
        keep_last, keep_every = self.tier_retention()
        if keep_last < 1 or (keep_every or 0) < 0:
            raise ConfigError(
                f"--tier-keep-last {keep_last} / --tier-keep-every {keep_every}: the bucket "
                "keeps at least 1 checkpoint, and milestones are 0 (off) or a step count"
            )
        if not self.job or "/" in self.job:
            raise ConfigError(f"--rdzv-id {self.job!r}: use a non-empty name without '/'")
        self.endpoint()  # a bad --rdzv-endpoint fails here, before the run directory exists
        if self.chaos:
            from stalwart.chaos import FaultPlan

            plan = FaultPlan.parse(self.chaos)  # one line quoting the bad token
            plan.check_targets(world_size=self.world_size, nnodes=self.nnodes)

    def _check_strategy(self, strategy: Strategy, given: str) -> None:
        """The flags that only some strategies take."""
        if strategy.uses_spares and self.spares < 1:
            raise ConfigError("--strategy spare needs --spares N (N >= 1 standby workers)")
        if self.replica_rate_mb_s < 0:
            raise ConfigError("--replica-rate must be >= 0 MB/s (0: no replicas)")
        if self.standby and not strategy.replaces_in_place:
            raise ConfigError(
                f"--standby needs --strategy flash or spare (got {given!r}): "
                "only they replace a lost node's ranks in place"
            )
        if self.standby and self.nnodes < 2 and not strategy.uses_spares:
            raise ConfigError(
                "--standby needs --nnodes >= 2 under flash (it stands by for another node), "
                "or --strategy spare (it also stands by for this node's own ranks)"
            )
        if strategy.syncs_replica_groups:
            self._check_async()

    def _check_async(self) -> None:
        size = replica_group_size(self.world_size, self.runtime.replica_groups)
        if self.nproc_per_node % size:
            raise ConfigError(
                f"--replica-groups {self.runtime.replica_groups} makes groups of {size} "
                f"workers across nodes of {self.nproc_per_node}: a replica group restarts "
                "as one on its node, so use groups that fit in a node (size dividing "
                "--nproc-per-node)"
            )
        if self.runtime.persist_every < 0:
            raise ConfigError(
                "--persist-every auto under --strategy async: the groups must persist the "
                "same steps (a relaunch resumes from the newest step all of them hold): "
                "give a number of steps"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def min_world(self) -> int:
        """Fewest workers the job trains with (elastic); the full size otherwise."""
        nodes = self.min_nnodes if self.min_nnodes is not None else self.nnodes
        procs = self.min_nproc_per_node
        if procs is None:
            procs = self.nproc_per_node
        return nodes * procs if self.strategy.resizes else self.world_size

    @property
    def local_ranks(self) -> list[int]:
        base = self.node_rank * self.nproc_per_node
        return list(range(base, base + self.nproc_per_node))

    @property
    def etcd(self) -> bool:
        """The coordinator store is etcd (no node hosts it; any node may be lost)."""
        return self.rdzv is not None

    @functools.cached_property
    def node_address(self) -> str:
        """The address this node's listeners bind and advertise to the other nodes
        (``replica_host``, else the route to the rendezvous: agent/cluster/_address.py). Raises
        ``ConfigError`` for a multi-host node whose host name resolves to loopback."""
        rendezvous: tuple[str, int] | None = None
        if self.etcd:
            from stalwart.coordinator import parse_etcd_url

            rendezvous = parse_etcd_url(str(self.rdzv)).endpoints[0]
        elif self.rdzv_endpoint:
            rendezvous = self.endpoint()
        return resolve_node_address(self.replica_host, rendezvous, self.nnodes > 1 or self.etcd)

    def endpoint(self) -> tuple[str, int]:
        if not self.rdzv_endpoint:
            return "127.0.0.1", 0
        return parse_endpoint(self.rdzv_endpoint)


def _check_failure_limits(crash_loop_limit: int, n: int) -> None:
    if crash_loop_limit < 1:
        raise ConfigError(
            f"--crash-loop-limit {crash_loop_limit}: use >= 1 (failures in a row "
            "at the same step before the job ends with a verdict)"
        )
    if not 1 <= n <= 1_000_000:
        raise ConfigError(
            f"--blocklist-after {n}: use 1..1000000 (failures of one member within 10 "
            "minutes before it is blocklisted)"
        )
