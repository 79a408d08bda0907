"""Every name a job uses in /dev/shm (the slot files behind them: checkpoint/slots.py).

Why one owner: the names of a job's shared-memory objects (rank slots, a buddy's
replicas, the progress board, rank 0's step journal, a standby's activation file) are
agreed between processes that never talk to each other about them: the worker that
writes a slot, its replacement that restores from it, the agent that replicates it to a
buddy node, the buddy's receiver, a parked standby that preloads it, the teardown that
removes them. A name built by hand in each of those places drifts; :class:`SlotNames`
builds all of them from the same three inputs.

Why a per-run component (``run``): /dev/shm is shared by every user of a host. Names
derived from the job id alone can be guessed by another local user, who could then
create the job's slot directory first (a denial of service: the job refuses a
directory it does not own) or place a link where a file will be created. Under
``stalwart run`` the first agent draws 64 random bits (:func:`new_run_id`), publishes
them in the job's coordinator store (``launch/shm``: a compare-and-swap, so every node
reads back the same value, a replacement agent included) and hands them to every worker
in its contract (``shm_run``, contract/env.py); names then read
``stalwart-<job>-<run>-...``. Outside ``stalwart run`` (plain python, torchrun) there
is no one to agree a secret with and ``run`` is empty: the names are the job id's alone
and the owner checks of checkpoint/_shm.py are the whole defence. docs/security.md
states the model.

The trust model does not rest on the names being secret (``/dev/shm`` is listable):
directories are created 0700 and an existing one is accepted only if it is a real
directory owned by this user (checkpoint/slots.py ``ensure_private_dir``), and every
file in them is opened ``O_NOFOLLOW``. The unpredictable part stops the squatting that
would otherwise happen *before* the job creates its names.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

from stalwart.errors import ConfigError

__all__ = ["REPLICA_MARKER", "SHM_DIR", "SlotNames", "new_run_id", "slot_dir"]

SHM_DIR = "/dev/shm"
"""Where a job's names live unless a config says otherwise (tests)."""


def slot_dir(shm_dir: str, namespace: str) -> str:
    """The slot directory of ``namespace`` (a rank's, a replica's) under ``shm_dir``."""
    return os.path.join(shm_dir, f"stalwart-{namespace}")


REPLICA_MARKER = "replica.json"
"""In a rank's slot directory taken over from a buddy's replica (agent side), consumed
by the rank's restore, which then reports the ``replica`` tier (runtime side)."""

_RUN_RE = re.compile(r"^[0-9a-f]{16}$")


def new_run_id() -> str:
    """A fresh per-run component: 64 random bits, hex (a name no one can guess)."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class SlotNames:
    """The /dev/shm names of one job's run on this host."""

    job: str
    """The job id (``--rdzv-id``): what every process of the job knows."""
    run: str = ""
    """The per-run component (:func:`new_run_id`), shared through the coordinator store
    and the worker environment; empty outside ``stalwart run`` (no one to share it
    with), which gives the job-id-only names."""
    shm_dir: str = SHM_DIR
    """Where the names live (tests point it elsewhere)."""

    def __post_init__(self) -> None:
        if not self.job or "/" in self.job or "\0" in self.job:
            raise ConfigError(f"job id {self.job[:80]!r}: use a non-empty name without '/'")
        if self.run and not _RUN_RE.match(self.run):
            raise ConfigError(
                f"shared-memory run id {self.run[:40]!r} is not 16 hex digits: it comes "
                "from the job's store (launch/shm) or the worker contract's shm_run; "
                "restart the job"
            )

    @property
    def stem(self) -> str:
        """``<job>-<run>`` (``<job>`` with no run): what every name of the run starts
        with after ``stalwart-`` (the owner record's name too, checkpoint/slots.py)."""
        return f"{self.job}-{self.run}" if self.run else self.job

    # -- slot namespaces (a directory each: slot_dir(shm_dir, namespace)) ----------
    def rank(self, rank: int) -> str:
        """The namespace of ``rank``'s own snapshot slots."""
        return f"{self.stem}-r{rank}"

    def replica(self, rank: int) -> str:
        """The namespace a buddy node keeps ``rank``'s replicated slots under."""
        return f"{self.stem}-replica-r{rank}"

    def rank_dir(self, rank: int) -> str:
        return slot_dir(self.shm_dir, self.rank(rank))

    def replica_dir(self, rank: int) -> str:
        return slot_dir(self.shm_dir, self.replica(rank))

    def directory(self, namespace: str) -> str:
        """The slot directory of any namespace of this job (a received one)."""
        return slot_dir(self.shm_dir, namespace)

    # -- single files -------------------------------------------------------------
    def progress_board(self, node: int) -> str:
        """The agent's progress board of node ``node`` (contract/board.py)."""
        return os.path.join(self.shm_dir, f"stalwart-{self.stem}-progress-n{node}")

    def fence_file(self, node: int) -> str:
        """``node:revision`` of node ``node``'s agent lease once it rejoined within the
        partition grace (agent/cluster/_grace.py): its workers' fence from then on."""
        return os.path.join(self.shm_dir, f"stalwart-{self.stem}-fence-n{node}")

    def step_journal(self, pid: int) -> str:
        """Rank 0's step journal, written by process ``pid`` (metrics/journal.py)."""
        return f"{self._journal_prefix}{pid}"

    def journal_pid(self, path: str) -> int | None:
        """The pid of a :meth:`step_journal` path (None: not one of ours)."""
        prefix = self._journal_prefix
        tail = path[len(prefix) :] if path.startswith(prefix) else ""
        return int(tail) if tail.isdigit() and tail.isascii() else None

    def step_journals(self) -> list[str]:
        """Every step journal of this run on this host."""
        return sorted(p for p in self._listing() if self.journal_pid(p) is not None)

    @property
    def _journal_prefix(self) -> str:
        return os.path.join(self.shm_dir, f"stalwart-{self.stem}-steps-")

    def standby_go(self, rank: int, nonce: str) -> str:
        """The activation file of a parked standby of ``rank`` (agent/processes/_standby.py);
        ``nonce`` is the standby process's own, so a stale file never wakes the next."""
        return os.path.join(self.shm_dir, f"stalwart-{self.stem}-standby-r{rank}-{nonce}")

    # -- teardown -----------------------------------------------------------------
    def everything(self) -> list[str]:
        """Every /dev/shm entry of this run on this host (the last agent out removes
        them). Only this run's: another job whose id starts with ours is not touched."""
        return self._listing()

    def _listing(self) -> list[str]:
        head = f"stalwart-{self.stem}-"
        try:
            names = os.listdir(self.shm_dir)
        except FileNotFoundError:
            return []
        return [os.path.join(self.shm_dir, n) for n in names if n.startswith(head)]
