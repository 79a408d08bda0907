"""Shared fixtures (unique shared-memory namespaces, cleaned up after each test) and the
suite's two tiers: tests that start a process are marked ``e2e`` (tests/_tiers.py says
by which rule), every other test runs under a guard that fails it if it starts one, and
every test's pytest-timeout is scaled for the machine's load (tests/_load.py)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from _bytecode import bytecode_written, precompile
from _load import load_factor
from _tiers import PROCESS_PARAMS, ProcessGuard, starts_process
from _timing import TimeByFile
from _workers import group_for_workers
from hypothesis import HealthCheck, settings

# property tests check what a function returns, not how fast: no deadline and no "too
# slow" health check, which a loaded machine trips (a test's own @settings inherits these)
settings.register_profile("stalwart", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("stalwart")


def _is_e2e(item: pytest.Function) -> bool:
    if starts_process(item.function):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in item.fixturenames:
        for fixdef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if not starts_process(fixdef.func):
                continue
            only = PROCESS_PARAMS.get(name)
            if only is None or params.get(name) in only:
                return True
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    """The bytecode of src/ and examples/, for every process the run starts: CI sets
    PYTHONDONTWRITEBYTECODE, and each job's processes compiled stalwart anew (_bytecode.py)."""
    precompile()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    """The collection writes the bytecode of what it imports (the test files, rewritten
    by pytest, and their helpers); the tests themselves run under the environment's
    setting (_bytecode.py says why)."""
    with bytecode_written():
        return (yield)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark, before xdist reads groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        unmarked = isinstance(item, pytest.Function) and not item.get_closest_marker("e2e")
        if unmarked and _is_e2e(item):  # type: ignore[arg-type]
            item.add_marker(pytest.mark.e2e)
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        group_for_workers(items)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Scale the test's pytest-timeout (its mark, else the ini's) for the load now, before
    pytest-timeout reads it."""
    marker = item.get_closest_marker("timeout")
    kwargs = dict(marker.kwargs) if marker is not None else {}
    if marker is not None:
        base = marker.args[0] if marker.args else kwargs.pop("timeout", None)
        kwargs.pop("timeout", None)
    else:
        base = item.config.getoption("timeout", None) or item.config.getini("timeout")
    if base is not None and float(base) > 0:
        item.add_marker(pytest.mark.timeout(float(base) * load_factor(), **kwargs), append=False)
    yield


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when in ("setup", "call") and report.failed:
        item.stash[_CALL_FAILED] = True
    return report


_TIMES = TimeByFile()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _TIMES.add(report)


@pytest.hookimpl(trylast=True)  # the last lines of the run: CI's log keeps its tail
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = _TIMES.lines()
    if lines:
        terminalreporter.write_sep("=", "time by tier and by e2e file (tests/_timing.py)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test not marked ``e2e`` (or ``process``: a helper process of the library's own)
    may not start a process: the unit tier runs in one."""
    node = request.node
    if node.get_closest_marker("e2e") is not None or node.get_closest_marker("process"):
        yield
        return
    with ProcessGuard(request.node.nodeid) as guard:
        yield
    if guard.started and not request.node.stash.get(_CALL_FAILED, False):
        # (a test that failed on it says so already; one that swallowed the error fails here)
        pytest.fail(
            f"started a process without the e2e mark ({', '.join(guard.started)}): "
            "mark it e2e or process (tests/_tiers.py)",
            pytrace=False,
        )


@pytest.fixture
def shm_namespace() -> Iterator[str]:
    ns = f"test-{uuid.uuid4().hex[:10]}"
    yield ns
    shutil.rmtree(Path("/dev/shm") / f"stalwart-{ns}", ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _no_default_group_leaks() -> Iterator[None]:
    """A test module that initialised torch.distributed's default group in this process
    ends it with the module (its tests may share one): ``stalwart.init()`` refuses a
    process where one already exists (a script that called ``init_process_group`` first),
    so a leaked one would fail every later runtime test. A session's default group is
    undone with what else ``stalwart.init()`` installed (its ``init_process_group``
    refusal, which a later module that builds its own group would meet)."""
    yield
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    world = sys.modules.get("stalwart.runtime.comm._world")
    if world is not None:
        world.uninstall()  # the group is gone: what is left is the refusal to undo
