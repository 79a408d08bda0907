"""The step loop's own bookkeeping (``sess.steps()``, runtime/session.py drives it).

- ``_accounting.py``: :class:`~stalwart.runtime.steps._accounting.StepAccounting`, step
  times and p99, when to snapshot and persist, the commit plan the checkpoint engine
  carries out (checkpoint/commit.py), the ``steps``/``snapshot``/``persist_*`` events.
- ``_cadence.py``: the job's snapshot cadence record, and a sharded job's persist
  cadence under ``--persist-every auto``; ``_align.py``: snapshots only at the end of a
  gradient accumulation cycle.
- ``_progress.py``: the worker's line on its agent's progress board, the heartbeat.
- ``_metric_log.py``: ``sess.log`` values as sampled events.
- ``_faults.py``: the worker's side of chaos (step-keyed faults).
"""
