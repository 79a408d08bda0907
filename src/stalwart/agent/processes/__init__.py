"""The node's worker processes: how they are started, owned, watched and ended.

- _workers.py: :class:`~stalwart.agent.processes._workers.LocalWorkers`, the one owner of
  every worker, spare and pending spawn (pid, state, cause; the state machine is in its
  docstring), of the zygote client and of the progress board;
- _zygote.py: the zygote, a process that imported torch (and the script's imports:
  _preload.py, _local_preload.py) but ran no op, forked for every worker, spare and
  standby; _zygote_client.py: the agent's side of its protocol; _teardown.py: how a
  forked worker ends;
- _env.py: the environment a worker starts with (its ``contract.env.WorkerEnv``);
- _standby.py: parked standbys that take a lost node's ranks over;
- _proc.py: a process's CPU time and state from /proc;
- _trash.py: a lost node's shared memory, freed once this node recovered;
- _steps.py: the step records its processes could not write themselves (a killed
  process's open batch, from its journal; a plain script's steps, from the board);
- _chaos.py: the agent's side of chaos (time-keyed rank faults, node faults);
- in a plain script's workers (no ``stalwart.init()``): observe.py (its steps on the
  board, from the optimizer: _outer_step.py) and _plain_chaos.py (its step-keyed faults).
"""
