"""The tracked state and where it is kept.

- ``_tracking.py``: :class:`~stalwart.runtime.state._tracking.TrackedState`, the objects
  ``sess.track`` was given, whether they are replicas (DDP) or shards (FSDP2), the
  rank's checkpoint manager, the optimizer guard.
- ``_perrank.py``: the per-rank part of a replicated state on disk.
- ``_memory_tier.py``: the steps this rank's (or a same-host peer's) snapshot slots hold,
  and restoring one of them.
- ``_standby.py``: a standby parked before its first step, and its preload of its
  rank's replica into its state.
- ``_tier_roots.py``: the checkpoint roots' twins in the bucket tier (``--ckpt-tier``).
"""
