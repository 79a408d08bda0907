"""``stalwart.init()`` and :class:`Session`: the few lines a training script changes.

    sess = stalwart.init()
    model = DDP(build_model())                 # unchanged (runtime/_world.py)
    opt = torch.optim.AdamW(model.parameters())
    sess.track(model=model, optimizer=opt)     # hook + snapshots + rollback
    for step in sess.steps(total=1000):        # 1..total; recovers between steps
        loss = train_step(model, opt, batch_for(step, sess.rank))

A step is a transaction: if its allreduce fails (a peer died or was killed for a hang),
the optimizer step is skipped, and before the next step the session joins the next
generation, rolls the tracked state back to the newest step every member holds, rebuilds
the process group and resumes from there. The DDP, optimizer and scheduler objects are
kept: only their tensors are rewritten.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from stalwart.checkpoint.catalog import committed_steps
from stalwart.errors import ReplicaMismatchError
from stalwart.logs import install_unless_configured
from stalwart.runtime._accounting import StepAccounting
from stalwart.runtime._coord import GenerationWatch, c10d_store, fence_compares, open_store
from stalwart.runtime._faults import fire_worker_faults
from stalwart.runtime._memory import (
    committed_disk_steps,
    holds_replica,
    memory_steps,
    restore_agreed,
)
from stalwart.runtime._perrank import PerRankPart, check_values
from stalwart.runtime._rendezvous import agree, finish_barrier, no_common_point
from stalwart.runtime._replicas import check_replicas, replicated_modules
from stalwart.runtime._standby import Preload
from stalwart.runtime._tracking import guard_optimizer, open_checkpoints
from stalwart.runtime._world import follow, install, localize
from stalwart.runtime.env import WorkerEnv
from stalwart.runtime.group import GenerationGroup, leak_abandoned

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
    def __init__(self, env: WorkerEnv, caller: dict[str, Any] | None = None) -> None:
        from stalwart.chaos import FaultLedger, FaultPlan
        from stalwart.metrics.events import EVENTS_FILE, EventLog

        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.generation = 0
        self.step = 0  # last completed step
        self.metrics: dict[str, Any] = {}  # the last values given to log()
        self.events: EventLog | None = None
        self.store: Any = None
        self.coord: Any = None
        self._board: Any = None
        self._stop = threading.Event()
        self._genwatch: GenerationWatch | None = None
        if env.managed:
            from stalwart.agent.progress import ProgressBoard
            from stalwart.coordinator import Coordinator, CoordinatorConfig

            self.events = EventLog(
                os.path.join(env.run_dir, EVENTS_FILE), node=env.node_rank, rank=env.rank
            )
            self.store = open_store(env)
            self.coord = Coordinator(self.store, CoordinatorConfig(job_id=env.job))
            if env.rdzv:
                self._genwatch = GenerationWatch(self.coord)
            if env.progress:
                from stalwart.agent.observe import detach

                detach()  # the zygote watched this worker as a plain script until now
                self._board = ProgressBoard(env.progress, env.progress_slot + 1)
                threading.Thread(target=self._heartbeat, name="stalwart-alive", daemon=True).start()
        self.plan = FaultPlan()
        self.ledger: FaultLedger | None = None
        if env.chaos_plan and os.path.exists(env.chaos_plan):
            with open(env.chaos_plan) as f:
                self.plan = FaultPlan.from_json(f.read())
            self.ledger = FaultLedger(env.run_dir)
        self.group = GenerationGroup(
            env.c10d,
            env.rank,
            env.world_size,
            env.collective_timeout_s,
            # the restart in the name: workers of an earlier launch that reached this
            # generation before they were killed left addresses that must not be used
            f"{env.job}.r{env.restart_count}",
            # under plain torchrun, rank 0 hosts the store unless torchrun's agent does
            is_master=not env.managed and env.rank == 0 and not env.agent_store,
            store=c10d_store(env, self.store),
        )
        self.group.on_collective = self._on_collective
        # formation: a member that never comes is retried after at most 60 s; a step's
        # allreduce waits the whole collective timeout (a peer may be in sess.pause)
        self.group.timeout = timedelta(seconds=min(60.0, env.collective_timeout_s))
        self.group.step_timeout = timedelta(seconds=env.collective_timeout_s)
        # the job's default group (dist.all_reduce, get_world_size) and DDP's local one
        install(self.group, env.job, caller)
        if self._genwatch is not None and env.strategy != "elastic":
            self.group.moved = self._genwatch.moved.is_set  # leave a stuck collective
        self.acct = StepAccounting(self)
        self._state: dict[str, Any] = {}
        self._mesh: Any = None
        self._ckpt: Any = None
        self._part: PerRankPart | None = None  # replicated: this rank's own state on disk
        self._replicated = False
        self._preload: Preload | None = None  # a parked standby's (runtime/_standby.py)
        self._phase = "starting"
        self._t_progress = time.time()
        self._paused: list[str] = []  # open sess.pause(...) blocks, innermost last
        self._paused_s = 0.0  # time paused within the current step (not step time)
        self._elastic: Any = None
        if env.managed and env.strategy == "elastic":
            from stalwart.runtime._elastic import Elastic

            self._elastic = Elastic(self)

    # ------------------------------------------------------------ progress board
    def _publish(self, phase: str | None = None) -> None:
        if phase is not None:
            self._phase = phase
        if self._board is not None:
            now = time.time()
            self._board.write(
                self.env.progress_slot,
                pid=os.getpid(),
                step=self.step,
                phase=self._phase,
                generation=self.generation,
                t_progress=self._t_progress,
                t_alive=now,
                p99_s=self.acct.p99(),
            )

    def _heartbeat(self) -> None:
        while not self._stop.wait(0.1):
            if self._board is not None:
                self._board.touch(self.env.progress_slot, time.time())

    def _on_collective(self, entering: bool) -> None:
        # a failed collective means recovery is next: never look like a stuck computation
        failed = not entering and self.group.error is not None
        after = "paused" if self._paused else "step"
        self._publish("collective" if entering else "recovering" if failed else after)

    @contextlib.contextmanager
    def pause(self, what: str = "non-step work") -> Iterator[None]:
        """Declare work that is not a training step (an eval, a save, ``generate()``)::

            if step % eval_every == 0 and sess.rank == 0:
                with sess.pause("eval"):
                    val_loss = evaluate(model)

        While inside, the agent never judges this rank by its step time, nor its peers
        for waiting for it (only a stopped process is a hang); the time does not count
        as step time. The peers wait in their next collective as usual."""
        t0 = time.perf_counter()
        self._paused.append(what)
        self._publish("paused")
        try:
            yield
        finally:
            self._paused.pop()
            if not self._paused:
                self._paused_s += time.perf_counter() - t0
                self._t_progress = time.time()  # the pause ended: progress, not a stall
                self._publish("step")

    @property
    def mesh(self) -> Any:
        """A 1-D DeviceMesh for FSDP2 (``fully_shard(m, mesh=sess.mesh)``) whose process
        group runs every collective over the current generation's group (runtime/_fsdp.py)."""
        if self._mesh is None:
            from stalwart.runtime._fsdp import generation_mesh

            self._mesh = generation_mesh(self.group, self.env.job, self._elastic is not None)
        return self._mesh

    # ------------------------------------------------------------ tracking
    def track(self, **state: Any) -> dict[str, Any]:
        """Register the training state (model, optimizer, scheduler, loader, anything
        with ``state_dict``, tensors, and dicts of small Python values such as
        ``meta={"best_val_loss": 1e9}``: mutate the dict, it is rolled back with the
        step). The process RNGs are tracked too. A DDP model gets the generation comm
        hook; an optimizer's ``step`` is skipped in a failed step. docs/porting.md says
        what is and is not rolled back."""
        from stalwart.checkpoint import RNGState
        from stalwart.runtime._fsdp import refuse_sharded_persist

        refuse_sharded_persist(state, self.env.persist_every, self.world_size)
        check_values(state)  # a tracked dict holds only what a checkpoint stores
        for value in state.values():
            if isinstance(value, torch.nn.parallel.DistributedDataParallel):
                localize(value)  # DDP over a local group, gradients through the hook
                self.group.attach(value)
            if isinstance(value, torch.optim.Optimizer):
                guard_optimizer(self.group, value)
        # the process RNGs are held here (as "_rng") unless the script tracks its own
        # RNGState: one copy, never two of the same generators
        held = any(isinstance(v, RNGState) for v in state.values())
        self._state = {**state} if held else {**state, "_rng": RNGState()}
        self._replicated = any(
            isinstance(v, torch.nn.parallel.DistributedDataParallel) for v in state.values()
        )
        if not self.env.standby:  # a parked standby opens them when activated
            open_checkpoints(self)
        return self._state

    def use_batch(self, config: Any) -> None:
        """The global batch policy (a :class:`stalwart.data.BatchConfig`): after every
        resize the tracked loaders get the plan's per-rank batch and micro-batches and
        the optimizers its LR scale (docs/data.md). Call after :meth:`track`."""
        from stalwart.runtime._elastic import use_batch

        use_batch(self, config)

    @property
    def step_ok(self) -> bool:
        """False while the current step is failed (it will be discarded and redone)."""
        return self.group.error is None

    def log(self, **metrics: Any) -> None:
        """Record scalar metrics of the current step: ``loss`` feeds the report's loss
        curve and ``--reference``; rank 0 writes them as events, sampled (tensors are
        read with .item() only when written; runtime/_metric_log.py)."""
        # detached: a loss kept here must not keep its step's autograd graph alive
        self.metrics.update(
            {k: v.detach() if hasattr(v, "detach") else v for k, v in metrics.items()}
        )
        if self.rank == 0:
            self.acct.metrics.log(metrics)

    # ------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers 1..total; between steps, snapshot, detect, recover."""
        if not self._state:
            raise RuntimeError("call Session.track(...) before Session.steps()")
        if self.env.standby:
            from stalwart.runtime._standby import park

            park(self)  # until the agent hands us a lost node's rank
            open_checkpoints(self)
        self._join(min_generation=0)
        while True:
            if self.step >= total:
                if self._finish(total):
                    if self._elastic is not None:
                        self._elastic.finished()
                    return
                self._recover("finish barrier broken")
                continue
            if self._genwatch is not None and self._genwatch.moved.is_set():
                self.group.close()  # its sockets close: old peers stuck in it fail now
                self._recover("the generation moved on (a node was lost)")
                continue
            step = self.step + 1
            self._fire_chaos(step)
            t0 = time.perf_counter()
            self._paused_s = 0.0
            self._publish("step")
            if self._elastic is not None:
                self._elastic.before_step()
            yield step
            err = self.group.reset_step()
            if err is not None:
                self._recover(f"collective failed in step {step}: {err}".splitlines()[0])
                continue
            self.acct.step_done(step, t0 + self._paused_s)  # a pause is not step time
            self.step = step
            self._t_progress = time.time()
            self.acct.maybe_snapshot(step, final=step >= total)
            self._publish()
            if self._elastic is not None:
                self._elastic.after_step(step)

    def _fire_chaos(self, step: int) -> None:
        fire_worker_faults(self, step)

    # ------------------------------------------------------------ recovery
    def _join(self, min_generation: int) -> None:
        """Agree on a restore point at the current generation, restore, form the group."""
        if self._elastic is not None:
            self._elastic.join(min_generation)
            return
        self._publish("recovering")
        t0 = time.perf_counter()
        snap = self._ckpt.snapshots
        while True:
            if self.coord is None:  # alone: nothing to agree on
                self.group.build(0)
                self._formed_group(0, fresh=True)
                self.acct.snapshot_now(0)
                self._publish("step")
                return
            use_memory = self.env.strategy != "restart"
            disk = self._disk_step()
            info = {
                "steps": memory_steps(snap) if use_memory else [],
                "done": self.step,
                "rank": self.rank,
                "host": socket.gethostname(),
                "replicated": self._replicated,
            }
            if holds_replica(snap):  # slots a buddy kept for our lost node
                info["replica"] = True
            if not self._replicated:  # own shards on disk: agree on a step all ranks hold
                info["disk"] = committed_disk_steps(self._ckpt.storage)
            elif self._part is not None:  # rank 0's copy and this rank's own part
                info["disk"] = self._part.disk_steps(committed_disk_steps(self._ckpt.storage))
            a = agree(
                self.store,
                self.coord,
                self.env.job,
                self.rank,
                self.world_size,
                info,
                use_memory=use_memory,
                disk_step=disk,
                min_generation=min_generation,
                timeout_s=self.env.hang_ceiling_s,
                fence=fence_compares(self.env),
                launch=self.env.restart_count,
            )
            t_restore = time.perf_counter()
            nbytes, tier, preloaded = restore_agreed(self, a, use_memory=use_memory)
            restored = a.target if a.target is not None else 0
            # raises: trained (or preloaded) state, and nowhere to go
            touched = self._preload is not None and self._preload.touched
            no_common_point(a, self.step, self.rank, preloaded=touched)
            if self.events is not None and a.tier != "none":
                self.events.emit(
                    "restore",
                    step=restored,
                    tier=tier,
                    seconds=time.perf_counter() - t_restore,
                    bytes=nbytes,
                    **({"preloaded": True} if preloaded else {}),
                )
            try:
                self.group.build(a.generation)
                self._formed_group(restored, fresh=a.target is None)
            except ReplicaMismatchError:
                raise
            except Exception:
                if self.coord.generation() == a.generation:
                    self.coord.advance_generation(a.generation, "group formation failed")
                min_generation = a.generation + 1
                continue
            self.generation = a.generation
            if self._genwatch is not None:
                self._genwatch.follow(a.generation)
            lost = max(0, a.last_done - restored) if a.generation > 0 else 0
            self.step = restored
            self._t_progress = time.time()
            if a.target is None:
                self.acct.snapshot_now(0)
            if self.rank == 0 and self.events is not None and a.generation > 0:
                self.events.emit(
                    "recovery_end",
                    strategy=self.env.strategy,
                    generation=a.generation,
                    restored_step=restored,
                    steps_lost=lost,
                    source_tier=a.tier,
                    ok=True,
                )
            self.acct.recovered(time.perf_counter() - t0)
            self._publish("step")
            return

    def _formed_group(self, step: int, fresh: bool) -> None:
        """The default group follows; replicas made equal and compared (_replicas.py)."""
        follow(self.group)
        check_replicas(self.group, replicated_modules(self._state), step=step, fresh=fresh)

    def _disk_step(self) -> int | None:
        steps = committed_steps(self._ckpt.storage)
        return steps[-1] if steps else None

    def _recover(self, reason: str) -> None:
        self.acct.flush()
        if self.coord is None:
            raise RuntimeError(f"a step failed and there is no agent to recover with: {reason}")
        if self.coord.advance_generation(self.generation, reason).won and self.events:
            self.events.emit(
                "note", message=f"rank {self.rank} ended generation {self.generation}: {reason}"
            )
        self._join(min_generation=self.generation + 1)

    def _finish(self, total: int) -> bool:
        """All members reached ``total`` in this generation (else someone failed)."""
        self.acct.flush()
        self.acct.wait_persist()
        if self.store is None:
            return True
        done = finish_barrier(
            self.store,
            self.coord,
            f"/stalwart/{self.env.job}/done/{self.generation:012d}/",
            (self.rank, self.world_size, self.generation),
            self.env.hang_ceiling_s,
        )
        if done:
            self._publish("done")
        return done

    def close(self) -> None:
        self._stop.set()
        self.acct.close()
        if self._genwatch is not None:
            self._genwatch.close()
        leak_abandoned()
        if self._elastic is not None:
            self._elastic.close()
        if self._ckpt is not None:
            # under `stalwart run` the agent owns the slots (a replacement needs them)
            self._ckpt.close(unlink_snapshots=not self.env.managed)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        if self.events is not None:
            self.events.close()
