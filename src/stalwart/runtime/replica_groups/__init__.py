"""``--strategy async`` in the worker: replica groups that train apart and meet every H
steps (docs/async.md).

- ``_rejoin.py``: :class:`~stalwart.runtime.replica_groups._rejoin.AsyncRejoin`, a
  group's join and its rounds.
- ``_rounds.py``: the synchronisation rounds in the coordinator's store.
- ``_outer.py``: the outer step (DiLoCo, LocalSGD) and the parameter-set format.
"""
