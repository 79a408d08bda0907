"""How a worker talks to the job and forms a generation's group: the coordinator's
store, the process groups that follow the generations, and the one formation every
rejoin ends with.

- ``group.py``: :class:`~stalwart.runtime.comm.group.GenerationGroup`, one process group
  per generation under a DDP model built once (its comm hook), over a
  :class:`~stalwart.runtime.backend.GroupBackend` (runtime/backend.py: the seam).
- ``_formation.py``: what a rejoin returns and the session applies (the
  :class:`~stalwart.runtime.comm._formation.Rejoin` Protocol, ``Formation``,
  ``Position``), and ``form_group``: the generation's group built, the default group
  following, the replicas compared (``_replicas.py``: equal at a fresh start through
  rank 0's broadcast, checked at every formation).
- ``_world.py``: the job-wide default group ``stalwart.init()`` installs, DDP localised;
  ``_fsdp.py``: the FSDP2 mesh's swappable process group; ``_mesh.py``: N-D meshes
  (HSDP, FSDP beside TP) whose sub-groups follow the generations.
- ``_coord.py``: reaching the coordinator (embedded store or etcd), the worker's fence
  (its agent's lease), the generation watch, the store's keys for the sharded commit;
  ``_c10d_store.py``: a ``torch.distributed.Store`` over it (gloo's rendezvous under
  etcd); ``_fenced.py``: a worker refused by the fence says so in one line, then
  rejoins or exits.

The bottom of the runtime: it imports only runtime/backend.py. Nothing is imported from
this package's ``__init__`` (nor from the other sub-packages'): each module is imported
by its own name, so no import cycle runs through a package.
"""
