"""The node's own health: what a node checks about itself, before and during a job.

- probes.py: the health probes (host memory, /dev/shm, the checkpoint disk's space and
  write speed, NVML's ECC, XID, temperature and clock slowdowns) and the set
  ``--probes`` asks for;
- preflight.py: the paired preflight check (``--preflight``) that tells a slow node from
  a slow link before the first generation, and ``stalwart check`` (the same without a
  job); _preflight_round.py is one node's side of one round, a process of its own;
- _node.py: the agent's part (``NodeHealth``): the probes' watch thread, and a node
  that fails either taken out of the job (``isolate_node``);
- endpoint.py: the node's ``/healthz`` and ``/readyz`` for an orchestrator's probes.
"""
