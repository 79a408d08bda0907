"""The run directory (``--run-dir``) and what the agent keeps there.

- _claim.py: a reused run directory is rotated, never merged (``claim_run_dir``);
- _private.py: the directory and its records are the job user's (0700, 0600), one that
  someone else could write into is refused;
- _tier.py: the bucket tier of its ``ckpt/`` (``--ckpt-tier``, on node 0).
"""
