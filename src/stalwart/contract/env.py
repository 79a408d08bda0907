"""The agent-to-worker contract: what `stalwart run` tells each worker it starts.

One frozen dataclass, :class:`WorkerEnv`, is the whole contract: the agent builds one
per worker and serialises it with :meth:`WorkerEnv.to_environ`; ``stalwart.init()``
parses it back once with :meth:`WorkerEnv.from_environ`. Every default is stated here
and nowhere else (the agent's own config takes its defaults from :data:`DEFAULTS`).

Two parts travel (docs/worker-contract.md):

- torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` ...),
  set as torchrun sets them, because a plain script (one that never calls
  ``stalwart.init()``) reads them and must run unchanged;
- everything else as one JSON object in ``STALWART_CONTRACT``, carrying a ``version``.
  Why one variable and not one per field: a worker is forked from the zygote with its
  environment replaced wholesale (agent/processes/_zygote.py), so the contract is always written
  whole; a stray ``STALWART_*`` variable in the user's shell cannot leak into a worker
  as part of it; the version is checked once for every field; and no plain script reads
  it (only stalwart's own code does).

Parsing validates every field (type and bounds) and raises
:class:`~stalwart.errors.ContractError` naming the variable and the fix. The contract
only describes the job: ``stalwart.init()`` takes no argument it could override.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypedDict, TypeVar

from stalwart.contract._field_check import INTEGER, check_field, check_names
from stalwart.contract.strategy import STRATEGIES, Strategy, replica_group_size
from stalwart.errors import ContractError

__all__ = [
    "CONTRACT_VAR",
    "CONTRACT_VERSION",
    "DEFAULTS",
    "KNOBS",
    "NAN_POLICIES",
    "SDC_POLICIES",
    "STRATEGIES",
    "Strategy",
    "WorkerEnv",
    "WorkerFields",
    "check_value",
    "knob_values",
    "replica_group_size",
]

CONTRACT_VAR = "STALWART_CONTRACT"
"""The environment variable holding the stalwart part of the contract (JSON)."""
CONTRACT_VERSION = 5
"""Bumped on any change of the JSON part's fields or their meaning: the agent and its
workers always run the same installation, so a mismatch is a broken install."""


SDC_POLICIES = ("rollback", "evict", "report")
"""What a replica digest mismatch does (``--on-sdc``; runtime/integrity/_checks.py)."""
NAN_POLICIES = ("report", "rollback")
"""What a non-finite or spiking logged loss does (``--on-nan``)."""

_T = TypeVar("_T")
_AGENT_FIX = "it is written by `stalwart run`: start the worker with it, not by hand"


def _c(
    default: _T,
    *,
    var: str = "",
    low: float | None = None,
    gt: bool = False,
    lt: float | None = None,
    flag: str = "",
    choices: tuple[str, ...] = (),
    knob: bool = False,
) -> _T:
    """A contract field: ``var`` is the torchrun variable carrying it (empty: a key of
    the JSON part); ``low`` its lower bound (exclusive with ``gt``), ``lt`` an exclusive
    upper one; ``flag`` the `stalwart run` flag that sets it (named in the error's fix);
    ``choices`` the names it takes; ``knob``: a runtime knob, whose flag `stalwart run`
    generates from this field (cli/_knob_flags.py: the flag, its bounds, and the field's
    docstring as its help)."""
    meta = {"var": var, "low": low, "gt": gt, "lt": lt, "flag": flag, "choices": choices}
    meta["knob"] = knob
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker is told by its agent (or by torchrun, or nothing: one process)."""

    # ---- torchrun's variables (plain scripts read them too)
    rank: int = _c(0, var="RANK", low=0)
    """This worker's rank in the job (0..world_size-1); ``ROLE_RANK`` is the same."""
    world_size: int = _c(1, var="WORLD_SIZE", low=1)
    """Workers in the job (``ROLE_WORLD_SIZE`` is the same): the group's size."""
    local_rank: int = _c(0, var="LOCAL_RANK", low=0)
    """Index on this node (device choice); an adopted rank keeps its original one."""
    local_world_size: int = _c(1, var="LOCAL_WORLD_SIZE", low=1, flag="--nproc-per-node")
    """Workers per node, as torchrun says it."""
    node_rank: int = _c(0, var="GROUP_RANK", low=0, flag="--node-rank")
    """This node's index: events and chaos faults are keyed by it."""
    nnodes: int = _c(1, var="GROUP_WORLD_SIZE", low=1, flag="--nnodes")
    """Nodes in the job, as torchrun says it."""
    master_addr: str = _c("", var="MASTER_ADDR")
    """Node 0's host name: under plain torchrun the c10d store's host."""
    master_port: int = _c(0, var="MASTER_PORT", low=0)
    """With ``master_addr``, plain torchrun's c10d store (0: none given)."""
    restart_count: int = _c(0, var="TORCHELASTIC_RESTART_COUNT", low=0)
    """Whole-job restarts so far: part of the group namespace, so the addresses left
    by workers of an earlier launch are never dialled."""
    max_restarts: int = _c(0, var="TORCHELASTIC_MAX_RESTARTS", low=0, flag="--max-restarts")
    """Whole-job restarts allowed (torchrun's; read by scripts that log it)."""
    job: str = _c("local", var="TORCHELASTIC_RUN_ID")
    """The job id: every store key, slot and event of the job is under it."""
    agent_store: bool = _c(False, var="TORCHELASTIC_USE_AGENT_STORE")
    """torchrun's agent hosts the c10d store at MASTER_ADDR:MASTER_PORT (else, under
    plain torchrun, rank 0 does)."""

    # ---- stalwart's own, in STALWART_CONTRACT
    version: int = _c(CONTRACT_VERSION)
    """The JSON part's format; a worker refuses any other (see CONTRACT_VERSION)."""
    strategy: Strategy = _c(Strategy.FLASH, flag="--strategy")  # noqa: RUF009 (immutable)
    """The recovery strategy: how this worker rejoins after a failure (a name is parsed)."""
    run_dir: str = _c("")
    """The run directory: events.jsonl, ckpt/, errors/ and the chaos ledger live here."""
    store: tuple[str, int] | None = _c(None)
    """The coordinator's embedded store (host, port); None under etcd or with no agent."""
    token_file: str = _c("")
    """The job token that authenticates this worker to the embedded store."""
    c10d_addr: str = _c("")
    """``host:port`` of the TCPStore that outlives every worker (node 0's zygote hosts
    it): survivors form the next generation's group over it ("": MASTER_ADDR:PORT)."""
    rdzv: str = _c("", flag="--rdzv")
    """``etcd://...``: the coordinator (and the gloo rendezvous) live in etcd."""
    fence: str = _c("")
    """``NODE:CREATE_REVISION`` of the agent's member key (etcd): joins hold only while
    the agent's lease does, so a partitioned node's workers never rejoin."""
    progress: str = _c("")
    """The node's progress board (shared memory): the agent's hang detector reads it."""
    progress_slot: int = _c(0, low=0)
    """This worker's slot on the progress board."""
    chaos_plan: str = _c("", flag="--chaos")
    """The job's fault plan (JSON file; "": none): worker-side faults fire from it."""
    error_line: str = _c("")
    """Where the worker leaves the first line of its error (the crash-loop verdict)."""
    hang_ceiling_s: float = _c(300.0, low=0, gt=True)
    """Longest a step may look stuck before the agent calls it a hang: the runtime
    sizes its own waits (formation, peer restores) under it."""
    watch_wait_s: float = _c(5.0, low=1, lt=3601)
    """How long one long-poll of the worker's generation watch waits (the agent's own
    watches wait as long: one node lease, at least 5 s). A write answers it at once;
    only its count per second depends on it: at 1,024 nodes of 8 workers, 5 s waits
    were ~1,600 requests a second, the largest steady load (docs/scale.md)."""
    gen_relay: str = _c("")
    """Where the agent tells its workers the generation: ``@name``, a Unix socket of the
    abstract namespace, one ASCII line per new generation (docs/worker-contract.md).
    The worker follows it instead of a store watch of its own: no store request per
    worker in steady state, none per failure ("": watch the store)."""
    arrival_relay: str = _c("")
    """Where the worker arrives at an agreement through its agent: ``@name``, a Unix
    socket of the abstract namespace (docs/worker-contract.md, "The arrival relay").
    The agent writes its workers' arrivals in one transaction and follows the agreement
    with one watch for all of them ("": the worker asks the store itself)."""
    persist_every: int = _c(0, low=-1, flag="--persist-every", knob=True)
    """Steps between persisted checkpoints (0: off; -1, 'auto' on the command line:
    Young/Daly from the observed persist time and MTBF); `stalwart run` defaults to 20
    under --strategy restart, else 0."""
    snapshot_budget: float = _c(0.02, low=0, flag="--snapshot-budget", knob=True)
    """Largest snapshot stall as a fraction of step time: sets how often the workers
    snapshot to memory."""
    snapshot_every: int = _c(0, low=0, flag="--snapshot-every", knob=True)
    """A fixed snapshot cadence in steps (0: chosen from the budget); with
    --replica-rate, keep it longer than one replication round."""
    collective_timeout_s: float = _c(1800.0, low=0, gt=True, flag="--collective-timeout", knob=True)
    """How long a step's allreduce waits for its peers (torchrun's 30 min): a peer in a
    long ``sess.pause`` makes the others wait; hangs are the agent's to find."""
    keep_last: int = _c(3, low=1, flag="--keep-last", knob=True)
    """Committed checkpoints kept per checkpoint directory (retention runs after each
    commit; the newest always is)."""
    keep_every: int = _c(0, low=0, flag="--keep-every", knob=True)
    """Also keep every step divisible by this as a milestone (0: none)."""
    ckpt_tier: str = _c("", flag="--ckpt-tier")
    """The bucket prefix ckpt/ is copied to ("": none): a restore reads the steps ckpt/
    lacks from it directly (checkpoint/manager.py ``tiers``)."""
    s3_endpoint: str = _c("", flag="--s3-endpoint")
    """The S3 endpoint of ``ckpt_tier`` ("": boto3's own settings)."""
    min_world: int = _c(1, low=1, flag="--nnodes MIN:MAX")
    """Elastic: the fewest members the job trains with."""
    elastic_wait_s: float = _c(600.0, low=0, gt=True, flag="--elastic-wait")
    """Elastic: how long the members wait below ``min_world`` before the job fails."""
    replica_groups: int = _c(0, low=0, flag="--replica-groups", knob=True)
    """Async: replica groups of consecutive ranks (0: one per worker)."""
    sync_every: int = _c(50, low=1, flag="--sync-every", knob=True)
    """Async: steps between two synchronisations of the replica groups (H)."""
    outer_lr: float = _c(0.7, low=0, gt=True, flag="--outer-lr", knob=True)
    """Async: the outer step's learning rate (1.0 with momentum 0, what --outer
    localsgd sets, is LocalSGD's mean)."""
    outer_momentum: float = _c(0.9, low=0, lt=1, flag="--outer-momentum", knob=True)
    """Async: the outer step's Nesterov momentum (DiLoCo's 0.9; 0 for LocalSGD)."""
    incarnation: str = _c("")
    """Elastic: this process's life of its member slot (registered by the agent)."""
    step_p99_s: float = _c(0.0, low=0)
    """The rank's p99 step time so far in the job: a replacement starts with its
    predecessor's, so its hang limit is not back at the floor."""
    standby: str = _c("")
    """A parked standby: the file whose appearance activates it (agent/processes/_standby.py)."""
    shm_run: str = _c("")
    """The run's unpredictable part of every /dev/shm name of the job
    (contract/shm_names.py): another user cannot guess, pre-create or squat them."""
    sdc_every: int = _c(0, low=0, flag="--sdc-every", knob=True)
    """Steps between comparisons of the DDP replicas' state digests (0: off): replicas
    must be bit-identical, so a mismatch is silent data corruption on a minority."""
    on_sdc: str = _c("rollback", flag="--on-sdc", choices=SDC_POLICIES, knob=True)
    """A digest mismatch: roll back to the newest snapshot every replica agreed on
    (``rollback``), and also evict the minority rank (``evict``), or only report it."""
    on_nan: str = _c("report", flag="--on-nan", choices=NAN_POLICIES, knob=True)
    """A non-finite or spiking ``sess.log(loss=...)``: report it, or roll back to the
    snapshot before it and skip that step's batch (``rollback``, one more small
    collective per step: every rank must decide at the same step)."""
    spike_z: float = _c(6.0, low=0, flag="--spike-z", knob=True)
    """A loss above mean + z * std of its running window is a spike (0: only NaN/inf)."""
    spike_window: int = _c(100, low=2, flag="--spike-window", knob=True)
    """How many recent finite losses (per rank) the spike's mean and std are over."""

    def __post_init__(self) -> None:
        for f in fields(self):
            where = f.metadata["var"] or f"{CONTRACT_VAR}.{f.name}"
            fix = f"set {f.metadata['flag']}" if f.metadata["flag"] else _AGENT_FIX
            check_field(f.name, f.metadata, f.default, getattr(self, f.name), where, fix)
        check_names(self.job, self.shm_run, _AGENT_FIX)
        if self.rank >= self.world_size:
            raise ContractError(
                f"RANK={self.rank} is outside 0..{self.world_size - 1} (WORLD_SIZE="
                f"{self.world_size}): the launcher sets both; unset RANK or fix WORLD_SIZE"
            )
        given = str.__str__(self.strategy)
        strategy = Strategy.parse(
            given,
            lambda fix: ContractError(
                f"{CONTRACT_VAR}.strategy={given!r} is not a strategy: {fix} (--strategy)"
            ),
        )
        object.__setattr__(self, "strategy", strategy)
        if self.version != CONTRACT_VERSION:
            raise _version_error(self.version)
        if self.c10d_addr and _addr(self.c10d_addr) is None:
            raise ContractError(
                f"{CONTRACT_VAR}.c10d_addr={self.c10d_addr!r} is not HOST:PORT: {_AGENT_FIX}"
            )

    @property
    def managed(self) -> bool:
        """Launched by `stalwart run` (else: plain python or torchrun)."""
        return self.store is not None or bool(self.rdzv)

    @property
    def replica_group(self) -> tuple[int, int, int] | None:
        """``--strategy async`` under `stalwart run`: (replica group, rank in it, its
        size), groups being consecutive launch ranks; None when the job is one group."""
        if not (self.managed and self.strategy.syncs_replica_groups):
            return None
        size = replica_group_size(self.world_size, self.replica_groups)
        return self.rank // size, self.rank % size, size

    @property
    def c10d(self) -> tuple[str, int] | None:
        """The TCPStore the generation groups form over: the agent's, else torchrun's
        MASTER_ADDR:MASTER_PORT, else None (one process)."""
        if self.c10d_addr:
            return _addr(self.c10d_addr)
        if self.master_addr and self.master_port:
            return self.master_addr, self.master_port
        return None

    # ------------------------------------------------------------------ the wire
    def to_environ(self) -> dict[str, str]:
        """The variables that carry this contract (merged over the agent's environment)."""
        out: dict[str, str] = {}
        blob: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["var"]:
                out[f.metadata["var"]] = str(value)
            elif f.name == "store":
                blob[f.name] = f"{value[0]}:{value[1]}" if value is not None else ""
            else:
                blob[f.name] = value
        out.update(
            {
                "ROLE_RANK": str(self.rank),
                "ROLE_WORLD_SIZE": str(self.world_size),
                "ROLE_NAME": "default",
                # for NCCL: a failed collective raises instead of hanging (torchrun's)
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                CONTRACT_VAR: json.dumps(blob, sort_keys=True, separators=(",", ":")),
            }
        )
        return out

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        """The contract in ``env`` (default: this process's environment). Without
        ``STALWART_CONTRACT`` (plain python or torchrun) the stalwart part is the
        defaults; the torchrun part is read either way."""
        e = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f.metadata["var"]
            if var and e.get(var, ""):
                values[f.name] = _parse_var(var, e[var], f.default)
        raw = e.get(CONTRACT_VAR, "")
        if raw:
            values.update(_parse_blob(raw, {f.name for f in fields(cls) if not f.metadata["var"]}))
        return cls(**values)


class WorkerFields(TypedDict, total=False):
    """Contract fields (:class:`~stalwart.contract.env.WorkerEnv`) a caller sets for one
    worker, on top of what the job and the node give every worker (``rank`` and
    ``world_size`` replace the launch's: a sharded elastic job restarted at a new size,
    agent/strategies/_elastic.py)."""

    rank: int
    world_size: int
    incarnation: str
    standby: str
    step_p99_s: float
    error_line: str
    rdzv: str
    fence: str
    shm_run: str
    arrival_relay: str


def _addr(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not (sep and host and INTEGER.fullmatch(port) and 0 < int(port) < 65536):
        return None
    return host, int(port)


def _parse_var(var: str, text: str, default: object) -> Any:
    """A torchrun variable's value, typed like its field's default."""
    if isinstance(default, bool):
        return text == "True"
    if isinstance(default, int):
        if INTEGER.fullmatch(text) and len(text) <= 19:
            return int(text)
        raise ContractError(
            f"{var}={text[:40]!r} is not an integer (ASCII digits): the launcher (torchrun "
            f"or `stalwart run`) sets it; unset {var} or give a whole number"
        )
    return text


def _version_error(version: object) -> ContractError:
    return ContractError(
        f"{CONTRACT_VAR} has version {version!r}, this stalwart reads version "
        f"{CONTRACT_VERSION}: the agent and the worker run different stalwart "
        "installations; launch the script with the `stalwart run` of its environment"
    )


def _parse_blob(raw: str, names: set[str]) -> dict[str, Any]:
    """The JSON part's fields, each still to be checked by ``WorkerEnv``."""
    try:
        blob = json.loads(raw)
    except ValueError:
        blob = None
    if not isinstance(blob, dict):
        raise ContractError(f"{CONTRACT_VAR} is not a JSON object: {_AGENT_FIX}")
    if blob.get("version") != CONTRACT_VERSION:  # before any field: one line, the version
        raise _version_error(blob.get("version"))
    unknown = sorted(set(blob) - names)
    if unknown:
        raise ContractError(f"{CONTRACT_VAR} has unknown fields {unknown}: {_AGENT_FIX}")
    store = blob.get("store")
    if store is not None:
        if not isinstance(store, str) or (store and _addr(store) is None):
            raise ContractError(f"{CONTRACT_VAR}.store={store!r} is not HOST:PORT: {_AGENT_FIX}")
        blob["store"] = _addr(store) if store else None
    return blob


DEFAULTS = WorkerEnv()
"""Every field's default: the agent's config (agent/config.py) takes its defaults here."""

KNOBS = tuple(f.name for f in fields(WorkerEnv) if f.metadata["knob"])
"""The runtime knobs: the fields `stalwart run` has a generated flag for, which the
agent hands on to every worker as they were given (``LaunchConfig.runtime``)."""


def check_value(name: str, value: object, where: str, fix: str) -> None:
    """``value`` has field ``name``'s type, bounds and choices, else a ContractError
    naming ``where`` (a flag, a variable) and ``fix``."""
    f = next(f for f in fields(WorkerEnv) if f.name == name)
    check_field(name, f.metadata, f.default, value, where, fix)


def knob_values(env: WorkerEnv) -> dict[str, Any]:
    """``env``'s runtime knobs, by field name (the agent's part of every worker's contract)."""
    return {name: getattr(env, name) for name in KNOBS}
