"""``stalwart.init()`` and :class:`Session`: the few lines a training script changes.

    sess = stalwart.init()
    model = DDP(build_model())                 # unchanged (runtime/comm/_world.py)
    opt = torch.optim.AdamW(model.parameters())
    sess.track(model=model, optimizer=opt)     # hook + snapshots + rollback
    for step in sess.steps(total=1000):        # 1..total; recovers between steps
        loss = train_step(model, opt, batch_for(step, sess.rank))

A step is a transaction: if its allreduce fails (a peer died or was killed for a hang) or
the job's generation moved on, the optimizer step is skipped, and the session joins the
next generation, rolls the tracked state back to the newest step every member holds,
rebuilds the group and resumes. DDP, optimizer and scheduler objects are kept."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stalwart.contract.env import WorkerEnv
from stalwart.logs import install_unless_configured
from stalwart.runtime.comm._coord import GenerationWatch, c10d_store, open_store, worker_coordinator
from stalwart.runtime.comm._fenced import CommitRefusals, stop_if_fenced
from stalwart.runtime.comm._formation import Formation, Rejoin
from stalwart.runtime.comm._world import install
from stalwart.runtime.comm.group import GenerationGroup, leak_abandoned
from stalwart.runtime.integrity._checks import Integrity, Rollback
from stalwart.runtime.rejoin._fixed import FixedRejoin
from stalwart.runtime.rejoin._rendezvous import finish_barrier
from stalwart.runtime.replica_groups._rejoin import AsyncRejoin, group_position
from stalwart.runtime.state._perrank import check_values
from stalwart.runtime.state._tracking import TrackedState
from stalwart.runtime.steps._accounting import StepAccounting
from stalwart.runtime.steps._faults import WorkerFaults
from stalwart.runtime.steps._progress import Progress

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.chaos import FaultLedger, FaultPlan
    from stalwart.coordinator import Coordinator, Store
    from stalwart.data import BatchConfig
    from stalwart.metrics.events import EventLog

__all__ = ["Session", "init"]


_SESSION: Session | None = None


def init() -> Session:
    """Join the job (or run alone when not launched by `stalwart run`)."""
    global _SESSION
    if _SESSION is None:
        install_unless_configured()  # diagnostics in stalwart's one format (stalwart.logs)
        # the caller's `from torch.distributed import init_process_group` is refused too
        _SESSION = Session(WorkerEnv.from_environ(), caller=sys._getframe(1).f_globals)
    return _SESSION


class Session:
    """The worker's runtime, of parts that each own their state: ``progress`` (the agent's
    progress board, pauses), ``tracked`` (the tracked state, its checkpoints), ``acct``
    (step timing, snapshot and persist cadence, step events), the chaos plan, and a rejoin
    (fixed or elastic) whose :class:`Formation` the session applies in :meth:`_apply`, the
    one writer of ``generation``, ``rank``, ``world_size`` and, with the loop, ``step``."""

    def __init__(self, env: WorkerEnv, caller: dict[str, Any] | None = None) -> None:
        self.env = env
        self._formation = Formation(0, env.rank, env.world_size, 0, "none")
        self._step = 0  # last completed step
        self.metrics: dict[str, Any] = {}  # the last values given to log()
        self.events: EventLog | None = None
        self.store: Store | None = None
        self.coord: Coordinator | None = None
        self._genwatch: GenerationWatch | None = None
        if env.managed:
            self._connect(env)
        self.progress = Progress(env, self._status)
        self.group = self._open_group(env, caller)
        self.tracked = TrackedState(env)
        self.acct = StepAccounting(env, self, self.tracked, self.events, self.coord, self.store)
        if self._genwatch is not None:  # a fenced commit: said, then its generation left
            self.acct.on_refused = CommitRefusals(self, self._genwatch.moved.set).refused
        self.integrity = Integrity(env, self.tracked, self.group, self, self.events)
        self.faults = WorkerFaults(env, self.events, self.acct.slow, self.integrity.inject)
        self._rejoin = self._open_rejoin(env)
        if (watch := self._genwatch) is not None:  # leave a stuck collective (elastic too)
            self.group.moved = lambda: watch.left(self.group.generation)
        self._mesh: DeviceMesh | None = None

    def _connect(self, env: WorkerEnv) -> None:
        from stalwart.metrics.events import EVENTS_FILE, EventLog

        path = os.path.join(env.run_dir, EVENTS_FILE)
        self.events = EventLog(path, node=env.node_rank, rank=env.rank)
        self.store = open_store(env)
        self.coord = worker_coordinator(env, self.store)  # its bumps fenced by our agent's lease
        # every backend: a bump stops us; its long-poll waits as long as the agent's
        self._genwatch = GenerationWatch(self.coord, wait_s=env.watch_wait_s, relay=env.gen_relay)

    def _open_group(self, env: WorkerEnv, caller: dict[str, Any] | None) -> GenerationGroup:
        rank, world, job = group_position(env)  # async: the DDP group is a replica group
        group = GenerationGroup(
            env.c10d,
            rank,
            world,
            env.collective_timeout_s,
            # the restart in the name: workers of an earlier launch that reached this
            # generation before they were killed left addresses that must not be used
            f"{job}.r{env.restart_count}",
            # under plain torchrun, rank 0 hosts the store unless torchrun's agent does
            is_master=not env.managed and env.rank == 0 and not env.agent_store,
            store=c10d_store(env, self.store),
        )
        group.on_collective = self._on_collective
        # formation: a member that never comes is retried after at most 60 s; a step's
        # allreduce waits the whole collective timeout (a peer may be in sess.pause)
        group.timeout = timedelta(seconds=min(60.0, env.collective_timeout_s))
        group.step_timeout = timedelta(seconds=env.collective_timeout_s)
        # the job's default group (dist.all_reduce, get_world_size) and DDP's local one
        install(group, env.job, caller)
        return group

    def _open_rejoin(self, env: WorkerEnv, *, sharded: bool = False) -> Rejoin:
        parts = (env, self.group, self.tracked)
        resizes = env.strategy.resizes and not sharded  # sharded: resized by restarts
        if env.managed and (env.strategy.syncs_replica_groups or resizes):
            from stalwart.runtime.elastic._rejoin import ElasticRejoin

            assert self.coord is not None and self.store is not None
            if env.strategy.syncs_replica_groups:
                return AsyncRejoin(*parts, self.coord, self.store, self.events)
            return ElasticRejoin(*parts, self.coord, self.store, self.events, self.close)
        mem = env.strategy.restores_from_memory and not sharded
        return FixedRejoin(*parts, self, self.coord, self.store, self.events, use_memory=mem)

    # ------------------------------------------------------------ where it stands
    @property
    def generation(self) -> int:
        """The generation this worker last joined."""
        return self._formation.generation

    @property
    def rank(self) -> int:
        """This worker's rank in that generation (elastic: it may change)."""
        return self._formation.rank

    @property
    def world_size(self) -> int:
        """How many workers that generation has."""
        return self._formation.world_size

    @property
    def step(self) -> int:
        """The last completed step."""
        return self._step

    @property
    def plan(self) -> FaultPlan:
        return self.faults.plan

    @property
    def ledger(self) -> FaultLedger | None:
        return self.faults.ledger

    def _status(self) -> tuple[int, int, float]:
        return self._step, self.generation, self.acct.p99()

    def _publish(self, phase: str | None = None) -> None:
        self.progress.publish(phase)

    def _on_collective(self, entering: bool) -> None:
        self.progress.on_collective(entering, failed=not entering and self.group.error is not None)

    @contextlib.contextmanager
    def pause(self, what: str = "non-step work") -> Iterator[None]:
        """Declare work that is not a training step (``with sess.pause("eval"): ...``):
        inside, the agent never judges this rank by its step time, nor its peers for
        waiting for it (only a stopped process is a hang); it is no step time."""
        with self.progress.pause(what):
            yield

    @property
    def mesh(self) -> DeviceMesh:
        """A 1-D DeviceMesh for FSDP2 (``fully_shard(m, mesh=sess.mesh)``) over the current
        generation's group (runtime/comm/_fsdp.py); after :meth:`init_device_mesh`, that mesh."""
        if self._mesh is None:
            from stalwart.runtime.comm._fsdp import generation_mesh, resize_by_restarts

            if self._rejoin.resizes:  # elastic: sharded state resizes by restarts (_fsdp.py)
                resize_by_restarts(self.env, self.group, self.store, self._rejoin)
                self._rejoin = self._open_rejoin(self.env, sharded=True)
            self._mesh = generation_mesh(self.group, self.env.job)
        return self._mesh

    def init_device_mesh(
        self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]
    ) -> DeviceMesh:
        """torch's ``init_device_mesh("cpu", mesh_shape, mesh_dim_names=...)`` under
        stalwart, before the first step: ``((2, 2), ("replicate", "shard"))`` is HSDP, and a
        lost rank restores its shards from its ``replicate`` peer's memory
        (runtime/comm/_mesh.py)."""
        from stalwart.runtime.comm._fsdp import refuse_elastic_mesh
        from stalwart.runtime.comm._mesh import MeshLayout, layout_mesh

        refuse_elastic_mesh(self._rejoin.resizes)
        layout = MeshLayout(tuple(mesh_shape), tuple(mesh_dim_names))
        self._mesh = layout_mesh(self.group, self.env.job, layout)
        self.tracked.copy_key = layout.copy_key(self.rank)
        return self._mesh

    # ------------------------------------------------------------ tracking
    def track(self, **state: Any) -> dict[str, Any]:
        """Register the training state (model, optimizer, scheduler, loader, anything
        with ``state_dict``, tensors, and dicts of small Python values such as
        ``meta={"best_val_loss": 1e9}``: mutate the dict, it is rolled back with the
        step). The process RNGs are tracked too. A DDP model gets the generation comm
        hook; an optimizer's ``step`` is skipped in a failed step. docs/porting.md says
        what is and is not rolled back."""
        check_values(state)  # a tracked dict holds only what a checkpoint stores
        tracked = self.tracked.record(state, self.group)
        if not self.env.standby:  # a parked standby opens them when activated
            self._open_checkpoints()
        return tracked

    def align_steps(self, unit: int) -> None:
        """Snapshots, and so rollbacks, only at multiples of ``unit`` steps: a loop that
        steps its optimizer every ``unit`` steps (gradient accumulation) holds untracked
        partial gradients inside a cycle (integrations/accelerate.py)."""
        self.acct.alignment.align(unit, self.integrity.every if self.integrity.active else 0)

    def _open_checkpoints(self) -> None:
        self.tracked.open(self, self.events)
        self._rejoin.on_track(self.tracked.state)

    def use_batch(self, config: BatchConfig) -> None:
        """The global batch policy (:class:`stalwart.data.BatchConfig`; after :meth:`track`):
        after every resize the loaders get the plan's batches, the optimizers its LR scale."""
        self._rejoin.use_batch(config, self)

    @property
    def step_ok(self) -> bool:
        """False while the current step is failed (it will be discarded and redone)."""
        return self.group.error is None

    def log(self, **metrics: Any) -> None:
        """Record scalar metrics of the current step: ``loss`` feeds the report's loss
        curve and ``--reference``; rank 0 writes them as events, sampled (tensors are
        read with .item() only when written; runtime/steps/_metric_log.py)."""
        # detached: a loss kept here must not keep its step's autograd graph alive
        detached = {k: v.detach() if hasattr(v, "detach") else v for k, v in metrics.items()}
        self.metrics.update(detached)
        self.integrity.observe(metrics)  # NaN/inf and loss spikes (runtime/integrity/_spikes.py)
        if self.rank == 0:
            self.acct.metrics.log(metrics)

    # ------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers 1..total; between steps, snapshot, detect, recover."""
        if not self.tracked.state:
            raise RuntimeError("call Session.track(...) before Session.steps()")
        if self.env.standby:
            self._park()
        self._join(min_generation=0)
        while True:
            if self._step >= total:
                if self._finish(total):
                    self._rejoin.finished(self.rank)
                    return
                self._recover("finish barrier broken")
                continue
            if self._genwatch is not None and self._genwatch.moved.is_set():
                self.group.close()  # its sockets close: old peers stuck in it fail now
                self._recover("the generation moved on (a node was lost)")
                continue
            step = self._step + 1
            if not self.integrity.begin(step):
                self._step = step  # skipped after a numerical fault: its batch is dropped
                continue
            self.faults.fire(step)
            t0 = time.perf_counter()
            self.progress.step_started()
            self._rejoin.before_step(self._step)
            yield step
            err = self.group.reset_step()
            if err is not None:
                self._recover(f"collective failed in step {step}: {err}".splitlines()[0])
                continue
            self.acct.step_done(step, t0 + self.progress.paused_s)  # a pause is not step time
            self.progress.step_done()  # its compute time (the straggler detector's)
            self._step = step
            self.progress.progressed()
            back = self.integrity.after_step(step)  # every K steps or --on-nan rollback
            if back is not None:
                self._rolled_back(back)
                continue
            self.acct.maybe_snapshot(step, final=step >= total, force=self.integrity.due(step))
            self.integrity.snapshotted(step)
            self._publish()
            if step % self.acct.alignment.unit == 0 and self._rejoin.after_step(step):
                self._grow(step)

    def _park(self) -> None:
        """A standby: until the agent hands us a lost node's rank (runtime/state/_standby.py)."""
        from stalwart.runtime.state._standby import Preload, park

        preload = self.tracked.preload = Preload(self.tracked.names, self.rank)
        park(self.env.standby, preload, self.tracked.state, self._publish)
        self._open_checkpoints()

    # ------------------------------------------------------------ recovery
    def _join(self, min_generation: int) -> None:
        """Join a generation >= ``min_generation`` through the rejoin and apply it."""
        self._publish("recovering")
        t0 = time.perf_counter()
        with stop_if_fenced(lambda: self.rank):  # our agent's lease is gone: one line, exit
            formation = self._rejoin.join(min_generation, self._step)
        self._apply(formation, time.perf_counter() - t0)

    def _apply(self, f: Formation, seconds: float) -> None:
        """Where a formation becomes the session's (generation, rank, world size, step)."""
        self._formation = f
        self._step = f.step
        if self._genwatch is not None:  # "moved" means past this generation now
            self._genwatch.follow(f.generation)
        self._rejoin.adopt(f)
        self.progress.progressed()
        self.integrity.formed(f.step)
        if f.fresh:
            self.acct.snapshot_now(0)
            self.integrity.snapshotted(0)
        if f.rank == 0 and self.events is not None and f.generation > 0:
            self.events.emit(
                "recovery_end",
                strategy=self.env.strategy,
                generation=f.generation,
                restored_step=f.step,
                steps_lost=f.lost,
                source_tier=f.tier,
                ok=True,
            )
        self._rejoin.settle(f, seconds)
        self.acct.recovered(seconds)
        self._publish("step")

    def _rolled_back(self, back: Rollback) -> None:
        """runtime/integrity/_checks.py restored ``back.step`` in place on every rank:
        redo from it."""
        self.acct.flush()
        self._step = back.step
        self.acct.recovered(0.0)
        self._publish("step")
        if back.evict:
            self.integrity.evict()

    def _grow(self, step: int) -> None:
        """Stop at the boundary after ``step`` for joiners, then re-form."""
        self._publish("recovering")
        self.acct.flush()
        with stop_if_fenced(lambda: self.rank):  # admitting joiners bumps the generation
            min_generation = self._rejoin.admit(step, self)
        self._join(min_generation)

    def _recover(self, reason: str) -> None:
        self.acct.flush()
        if self.coord is None:
            raise RuntimeError(f"a step failed and there is no agent to recover with: {reason}")
        with stop_if_fenced(lambda: self.rank):  # the generation ends (async: restarts)
            self._rejoin.failed(self, reason)
        self._join(min_generation=self.generation + 1)

    def _finish(self, total: int) -> bool:
        """All members reached ``total`` in this generation (else someone failed)."""
        self.acct.flush()
        self.acct.wait_persist()
        if self.store is None or self.coord is None:
            return True
        key = f"/stalwart/{self.env.job}/done/{self.generation:012d}/"
        me = (self.rank, self.world_size, self.generation)
        done = finish_barrier(self.store, self.coord, key, me, self.env.hang_ceiling_s)
        if done:
            self._publish("done")
        return done

    def close(self) -> None:
        self.progress.close()
        self.acct.close()
        if self._genwatch is not None:
            self._genwatch.close()
        leak_abandoned()
        self._rejoin.close()
        self.tracked.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        if self.events is not None:
            self.events.close()
