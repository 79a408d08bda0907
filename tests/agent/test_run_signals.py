"""An agent run in a longer-lived process (a test suite, a notebook) takes SIGTERM for
its run, ignores Ctrl-C and SIGTERM for its teardown, and gives the process's own
handlers back at the end (agent/_outcome.py)."""

from __future__ import annotations

import signal
import threading

from stalwart.agent._outcome import Terminated, ignore_signals, signals_of_a_run


def test_the_processs_handlers_come_back_after_the_run() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with signals_of_a_run() as saved:
        assert saved == before
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        try:
            signal.raise_signal(signal.SIGTERM)
        except Terminated:
            pass
        else:
            raise AssertionError("SIGTERM did not end the run as Terminated")
        ignore_signals(saved)  # the teardown
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_run_in_a_thread_touches_no_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    ctrl_c = signal.getsignal(signal.SIGINT)  # ignored already where the suite runs in the
    got: list[object] = []  # background of a non-interactive shell

    def run() -> None:
        with signals_of_a_run() as saved:
            got.append(saved)
            ignore_signals(saved)
            got.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got[0] is None and got[1] is ctrl_c
    assert signal.getsignal(signal.SIGTERM) is before
