"""Silent data corruption and numerical faults, found between steps (docs/detection.md).

- ``_checks.py``: :class:`~stalwart.runtime.integrity._checks.Integrity`, the checks
  between steps (replica digests every ``--sdc-every`` steps, numerical faults in what
  ``sess.log`` is given), their rollbacks and their events.
- ``_digest.py``: what the digests read (the replicated tensors) and what chaos tampers
  with; ``_spikes.py``: non-finite values and loss spikes per rank.

The replicas' check at every formation is the formation's (runtime/comm/_replicas.py).
"""
