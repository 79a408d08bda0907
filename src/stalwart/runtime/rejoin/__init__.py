"""Joining a generation of a fixed-size job: every strategy but elastic and async.

- ``_fixed.py``: :class:`~stalwart.runtime.rejoin._fixed.FixedRejoin`, all
  ``world_size`` ranks arrive, agree, restore from the fastest tier that holds the
  step, form the group (runtime/comm/_formation.py: the ``Rejoin`` Protocol and the
  ``Formation`` every rejoin returns).
- ``_rendezvous.py``: the agreement on the restore point (memory, peer, disk) and the
  finish barrier; elastic's rejoin asks it too.
- ``_loops.py``: in-place recoveries that fail alike end in a verdict, not a loop.

The elastic rejoin is runtime/elastic/, the replica groups' runtime/replica_groups/.
"""
