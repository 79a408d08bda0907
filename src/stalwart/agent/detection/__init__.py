"""What the agent sees go wrong: each detector turns what it observes into a typed
incident (incidents.py) for the recovery policy (agent/strategies/).

The judgements are pure and public, each in its own module: a hang (hang.py: the board
and each process's CPU time), a straggler (stragglers.py: compute times), a degraded link
(degraded.py: the step rate against compute), a cut data plane (dataplane.py: every rank
waiting in a collective), a failure that will only repeat (verdict.py). The detectors
that feed them from the board, the zygote's exits and the store, and act on their
verdicts, are the private modules: _detectors.py (crash, hang, node loss, stragglers, and
:class:`~stalwart.agent.detection._detectors.Detectors`, which composes them),
_dataplane_watch.py, _degraded_watch.py, _hangwatch.py (the processes' CPU samples) and
_finished.py (whether the job already finished, as this node can tell).
"""
