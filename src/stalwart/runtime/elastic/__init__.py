"""``--strategy elastic`` in the worker: shrink on a failure, grow on a join, no restarts
(docs/elastic.md).

- ``_rejoin.py``: :class:`~stalwart.runtime.elastic._rejoin.ElasticRejoin`, composing the
  roster and the growth.
- ``_roster.py``: the roster of each generation, decided once in the store.
- ``_grow.py``: the admission of joiners at a step boundary (survivor and joiner sides);
  ``_joiners.py``: a joiner's request and the survivors' watcher that prefetches the
  state to it while training goes on.
- ``_live.py``: live rollback, a failed step undone in memory.
"""
