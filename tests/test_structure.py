"""The structure rules of the house, enforced on src/ by walking its AST (issue 14).

(a) no module imports a private module or name (``stalwart.x._y``, ``from stalwart.x
import _z``) of another part; (b) no module reads or writes another object's private
attribute; (c) no import cycle inside agent/ or runtime/, ``TYPE_CHECKING`` and
function-level imports included; (d) no module over 600 lines; (e) no function over 80
lines (its docstring and, in cli/, its argparse table calls not counted); (f) no string
comparison on the strategy name outside the CLI's parsing; (g) no other project's private
name (``torch._C``, ``c10d._world``, ``from x import _y``) used outside the seam,
src/stalwart/compat/, where a private attribute of another project's object is allowed
too (``DEPENDENCY_INTERNALS``); (h) each part imports only the parts ``PACKAGE_EDGES``
lists for it, with no cycle between parts, and importing ``stalwart.contract`` (the
agent-worker contract) loads no agent, runtime or torch module. The scan itself
is tests/_structure_scan.py, where each rule's precise reading is documented
(``.venv/bin/python tests/_structure_scan.py`` prints today's findings).

Today's code breaks these rules in many places and the agent, runtime, contract, slots
and snap lanes of issue 14 are removing them. ``ALLOWED`` below lists every violation
that exists now, exactly: the test fails on any finding not listed (a new violation)
AND on any listed entry that no longer occurs (fixed: delete its line), so the lists
only shrink. Whoever fixes a violation deletes its entry in the same commit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import _structure_scan as scan
import pytest

ALLOWED: dict[str, frozenset[str]] = {
    # (a) a private module of another part imported: none left (coordinator/elastic_keys,
    # agent/etcd_cluster and metrics/intervals are public modules of their parts).
    "private_import": frozenset({}),
    # (b) reach-ins into another object's internals: none left (the agent's and the
    # runtime's helpers taking `agent: Agent` / `sess: Session` are gone).
    "foreign_private_attribute": frozenset({}),
    # (c) the strongly connected components of each package's import graph (sorted
    # members): none left in agent/ or runtime/.
    "import_cycle": frozenset({}),
    # (d) modules over 600 lines.
    "long_module": frozenset({}),
    # (e) functions over 80 lines (module: qualified name).
    "long_function": frozenset({}),
    # (f) a value named for the strategy compared with a strategy's name as a string,
    # outside cli/: none left (agent/ and runtime/ ask the parsed contract.env.Strategy,
    # the simulator its sim.strategies.TRAITS).
    "strategy_comparison": frozenset({}),
    # (g) another project's private module, name or module attribute used outside
    # compat/: none (each lives in the seam, tests/compat/).
    "dependency_internal": frozenset({}),
}

# Not debt: a dependency's internals that stalwart uses on purpose, all in the seam
# (src/stalwart/compat/, where each is documented and tests/compat/ checks it on the
# installed versions). Kept apart from ALLOWED so that a new one is a reviewed decision,
# not silent; an entry outside compat/ fails test_dependency_internals_live_in_the_seam.
DEPENDENCY_INTERNALS = frozenset(
    {
        # Lightning: the fit loop's train fetcher, reopened at a rollback inside an epoch;
        # a logger's lazily picked version, pinned for a replaced rank 0
        "compat/lightning_trainer.py: fit_loop._data_fetcher",
        "compat/lightning_trainer.py: logger._version",
        # numpy pickles arrays through _reconstruct (the DCP import's unpickler allows it)
        "compat/numpy_pickle.py: multiarray._reconstruct",
        # c10d: the base collectives of a backend, which torch calls only by these names
        "compat/torch_c10d.py: pg._allgather_base",
        "compat/torch_c10d.py: pg._reduce_scatter_base",
        # DataLoader: stop its workers now, drop its persistent iterator
        "compat/torch_data.py: dl._iterator",
        "compat/torch_data.py: it._shutdown_workers",
        # DDP: the only way to move a built model onto another group
        "compat/torch_ddp.py: ddp._update_process_group",
        # transformers.Trainer: its inner loop (re-entered at a restored step), its
        # preparation and finalisation (wrapped), its summary totals, Accelerate's models
        "compat/transformers_trainer.py: trainer._finalize_training",
        "compat/transformers_trainer.py: trainer._globalstep_last_logged",
        "compat/transformers_trainer.py: trainer._initial_global_step",
        "compat/transformers_trainer.py: trainer._inner_training_loop",
        "compat/transformers_trainer.py: trainer._prepare_for_training",
        "compat/transformers_trainer.py: trainer._total_loss_scalar",
        "compat/transformers_trainer.py: trainer._tr_loss",
        "compat/transformers_trainer.py: trainer.accelerator._models",
    }
)

RULES = tuple(ALLOWED)

# Which part may import which (a part: a package of src/stalwart, or a top-level module;
# "stalwart" is the package's own __init__). Every import counts, TYPE_CHECKING and
# function-level ones too. The table is exact: an import along an edge not listed fails
# (a new dependency is a reviewed decision: add it here and to docs/architecture.md's
# drawing), and so does a listed edge that no module uses any more (delete it). No
# cycle between parts either way. The layers, bottom up: errors; privfile, userfile,
# logs, compat; contract, coordinator, metrics, chaos, data; sim, checkpoint; transfer;
# agent, runtime; integrations, the package, cli.
PACKAGE_EDGES: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "compat": frozenset(),
    "logs": frozenset(),
    "privfile": frozenset({"errors"}),
    "userfile": frozenset({"errors"}),
    # the agent-worker contract: the worker env, the strategy, the board, the shm names
    "contract": frozenset({"errors", "privfile"}),
    "coordinator": frozenset({"errors", "logs"}),
    "metrics": frozenset({"errors", "logs", "privfile", "userfile"}),
    "chaos": frozenset({"errors", "userfile"}),
    "data": frozenset({"compat", "errors"}),
    # the planner's Daly interval is the checkpoint's own (checkpoint/interval.py)
    "sim": frozenset({"checkpoint", "errors", "metrics", "userfile"}),
    "checkpoint": frozenset({"compat", "contract", "errors", "logs", "privfile", "userfile"}),
    "transfer": frozenset({"checkpoint", "contract", "coordinator", "errors", "logs"}),
    "agent": frozenset(
        {
            "chaos",
            "checkpoint",
            "compat",
            "contract",
            "coordinator",
            "errors",
            "logs",
            "metrics",
            "transfer",
        }
    ),
    "runtime": frozenset(
        {
            "chaos",
            "checkpoint",
            "compat",
            "contract",
            "coordinator",
            "data",
            "errors",
            "logs",
            "metrics",
            "transfer",
        }
    ),
    "integrations": frozenset({"checkpoint", "compat", "errors", "logs", "runtime", "stalwart"}),
    "stalwart": frozenset({"data", "errors", "runtime"}),
    "cli": frozenset(
        {
            "agent",
            "chaos",
            "checkpoint",
            "compat",
            "contract",
            "coordinator",
            "errors",
            "logs",
            "metrics",
            "sim",
            "stalwart",
        }
    ),
}


@pytest.fixture(scope="module")
def found() -> dict[str, set[str]]:
    return scan.findings()


@pytest.mark.parametrize("rule", RULES)
def test_no_new_violation(rule: str, found: dict[str, set[str]]) -> None:
    allowed = ALLOWED[rule] | (
        DEPENDENCY_INTERNALS if rule == "foreign_private_attribute" else set()
    )
    new = sorted(found[rule] - allowed)
    assert not new, f"new {rule} violation(s) (see tests/_structure_scan.py): {new}"


@pytest.mark.parametrize("rule", RULES)
def test_the_allowlist_only_shrinks(rule: str, found: dict[str, set[str]]) -> None:
    allowed = ALLOWED[rule] | (
        DEPENDENCY_INTERNALS if rule == "foreign_private_attribute" else set()
    )
    gone = sorted(allowed - found[rule])
    assert not gone, f"fixed, delete from ALLOWED[{rule!r}] in tests/test_structure.py: {gone}"


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return scan.package_edges(scan.modules())


def test_every_part_is_in_the_edge_table(edges: dict[str, set[str]]) -> None:
    missing = sorted(set(edges) - set(PACKAGE_EDGES))
    assert not missing, f"new part(s): give each its row in PACKAGE_EDGES: {missing}"
    gone = sorted(set(PACKAGE_EDGES) - set(edges))
    assert not gone, f"part(s) gone: delete their rows from PACKAGE_EDGES: {gone}"


def test_a_part_imports_only_what_the_edge_table_allows(edges: dict[str, set[str]]) -> None:
    new = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs - PACKAGE_EDGES.get(a, set()))
    assert not new, (
        f"import(s) along an edge not in PACKAGE_EDGES (tests/test_structure.py): {new}; "
        "import through a lower part, or add the edge there and to docs/architecture.md"
    )


def test_the_edge_table_lists_only_edges_in_use(edges: dict[str, set[str]]) -> None:
    unused = sorted(
        f"{a} -> {b}" for a, bs in PACKAGE_EDGES.items() for b in bs - edges.get(a, set())
    )
    assert not unused, f"no module imports along these: delete them from PACKAGE_EDGES: {unused}"


def test_no_cycle_between_parts() -> None:
    graph = {a: set(bs) for a, bs in PACKAGE_EDGES.items()}
    assert scan.cycles(graph) == [], "the edge table allows a cycle between parts"


# The agent's sub-packages (issue 32), bottom up: what each may import of the others. A
# sub-package's private modules may be imported anywhere inside agent/ (they are one part),
# but the roles stay layered: the strategies act on the detectors' incidents through the
# processes and the cluster; the cluster and the run directory import no other role.
AGENT_SUBPACKAGES: dict[str, frozenset[str]] = {
    "cluster": frozenset(),
    "rundir": frozenset(),
    "processes": frozenset({"cluster", "rundir"}),
    "detection": frozenset({"cluster", "processes"}),
    "health": frozenset({"cluster", "detection", "processes", "rundir"}),
    "strategies": frozenset({"cluster", "detection", "processes"}),
}


def test_the_agents_sub_packages_import_one_way() -> None:
    edges = scan.subpackage_edges(scan.modules(), "agent")
    assert set(edges) == set(AGENT_SUBPACKAGES), (
        f"agent/'s sub-packages changed: update AGENT_SUBPACKAGES and docs/architecture.md: "
        f"{sorted(edges)}"
    )
    new = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs - AGENT_SUBPACKAGES[a])
    assert not new, f"agent/: import(s) between sub-packages not in AGENT_SUBPACKAGES: {new}"
    unused = sorted(
        f"{a} -> {b}" for a, bs in AGENT_SUBPACKAGES.items() for b in bs - edges.get(a, set())
    )
    assert not unused, f"agent/: no module imports along these any more: {unused}"
    assert scan.cycles({a: set(bs) for a, bs in AGENT_SUBPACKAGES.items()}) == []


@pytest.mark.process  # a fresh interpreter (tests/_tiers.py)
def test_importing_the_contract_loads_no_agent_runtime_or_torch() -> None:
    """A worker reads its contract and writes the board; the agent, which never runs
    torch, does too: the contract must load neither side nor torch (a fresh process,
    so nothing this test run imported already counts)."""
    import subprocess
    import sys

    code = (
        "import sys, stalwart.contract, stalwart.contract.env, stalwart.contract.board, "
        "stalwart.contract.shm_names, stalwart.contract.strategy\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "m.startswith(('stalwart.agent', 'stalwart.runtime')))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", f"importing stalwart.contract loaded {out.stdout.strip()}"


def test_package_edges_count_every_import_once_per_pair() -> None:
    a = _mod("stalwart.agent.a", "from stalwart.contract.env import WorkerEnv\n")
    b = _mod(
        "stalwart.agent.b",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stalwart.runtime import x\n"
        "def f():\n    from stalwart.errors import E\n    from stalwart.agent import a\n",
    )
    c = _mod("stalwart.contract.env", "import os\nfrom stalwart.errors import E\n")
    assert scan.package_edges([a, b, c]) == {
        "agent": {"contract", "runtime", "errors"},
        "contract": {"errors"},
        "runtime": set(),
        "errors": set(),
    }
    assert scan.cycles({"agent": {"runtime"}, "runtime": {"agent"}, "errors": set()}) == [
        ["agent", "runtime"]
    ]


# The rules themselves, on made-up modules: each one must catch what it is for and
# nothing that the house allows.


def _mod(name: str, src: str) -> scan.Module:
    rel = name.removeprefix("stalwart.").replace(".", "/")
    path = scan.SRC / (rel + ".py")
    return scan.Module(path, name, ast.parse(src), src.count("\n"))


def test_a_private_import_of_another_part_is_found_wherever_it_hides() -> None:
    src = """
import importlib
from typing import TYPE_CHECKING
import stalwart.agent.processes._zygote
from stalwart import __version__
from stalwart.checkpoint import _internal, snapshot
from stalwart.checkpoint._shm import ShmSlot
from stalwart.runtime.state._memory_tier import peer_slots
if TYPE_CHECKING:
    from stalwart.coordinator._ops import Op
def later() -> None:
    from stalwart.metrics.report import _fmt
    importlib.import_module("stalwart.sim._x")
"""
    known = {"stalwart.checkpoint.snapshot"}
    assert scan.private_imports(_mod("stalwart.runtime.session", src), known) == {
        "stalwart.agent.processes._zygote",
        "stalwart.checkpoint._internal",
        "stalwart.checkpoint._shm",
        "stalwart.coordinator._ops",
        "stalwart.metrics.report._fmt",
        "stalwart.sim._x",
    }  # not runtime.state._memory_tier (the same part), not __version__ (a dunder)


def test_a_relative_import_resolves_to_its_part() -> None:
    mod = _mod("stalwart.agent.agent", "from ..checkpoint._shm import x\nfrom ._env import y\n")
    assert scan.private_imports(mod, set()) == {"stalwart.checkpoint._shm"}


def test_only_the_own_objects_internals_may_be_touched() -> None:
    src = """
import os
class Board:
    def __init__(self) -> None:
        self._slots = 1
    def __eq__(self, other: object) -> bool:
        return other._slots == self._slots and type(self)._cache is super()._cache
    def _peek(self) -> int:
        return self.__class__.__name__ and cls._made
def helper(agent, b: Board) -> None:
    agent._board.bump()
    agent.state._t_recovery = 3.0
    b._peek()
    getattr(agent, "_spawn")(1)
    setattr(agent, "_spawn", None)
    getattr(agent, "public")
    os._exit(3)
"""
    assert scan.foreign_private_attributes(_mod("stalwart.agent._x", src)) == {
        "agent._board",
        "agent.state._t_recovery",
        "agent._spawn",
    }


def test_dependency_internals_live_in_the_seam() -> None:
    outside = sorted(e for e in DEPENDENCY_INTERNALS if not e.startswith(f"{scan.SEAM}/"))
    assert not outside, (
        f"move these into src/stalwart/{scan.SEAM}/ (one module per dependency): {outside}"
    )


def test_another_projects_private_name_is_found_outside_the_seam() -> None:
    src = """
import importlib
import os
import sys
import threading
import torch._C._distributed_c10d as C
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.distributed_c10d import _world, get_rank
from stalwart.runtime import _world as ours
def f(ddp, pg) -> None:
    c10d._update_default_pg(pg)
    c10d._world.pg_map.clear()
    getattr(threading, "_shutdown")()
    importlib.import_module("numpy._core.multiarray")
    importlib.import_module("numpy.core")
    c10d.new_group()
    os._exit(0)
    sys._getframe(1)
    ddp._update_process_group(pg)
"""
    found = {
        "torch._C._distributed_c10d",
        "torch.distributed.tensor._utils",
        "torch.distributed.distributed_c10d._world",
        "c10d._update_default_pg",
        "c10d._world",
        "threading._shutdown",
        "numpy._core.multiarray",
    }  # not stalwart's own private module, not os._exit/sys._getframe (documented), not an
    # object's attribute (rule b), not public names
    assert scan.dependency_internals(_mod("stalwart.runtime.x", src)) == found
    assert scan.dependency_internals(_mod("stalwart.compat.torch_x", src)) == set()


def test_a_cycle_counts_type_checking_and_function_level_imports() -> None:
    a = _mod("stalwart.agent.a", "from stalwart.agent.b import B\n")
    b = _mod(
        "stalwart.agent.b",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stalwart.agent.a import A\n",
    )
    c = _mod("stalwart.agent.c", "def f():\n    from stalwart.agent import d\n")
    d = _mod("stalwart.agent.d", "import stalwart.agent.c\nimport stalwart.runtime.x\n")
    e = _mod("stalwart.agent.e", "from stalwart.agent.a import A\n")  # depends, no cycle
    graph = scan.import_graph([a, b, c, d, e], "agent")
    assert scan.cycles(graph) == [
        ["stalwart.agent.a", "stalwart.agent.b"],
        ["stalwart.agent.c", "stalwart.agent.d"],
    ]


def test_function_length_leaves_out_docstrings_and_cli_argument_tables() -> None:
    limit = scan.MAX_FUNCTION_LINES
    doc = '    """' + "why\n" * 80 + '    """\n'
    code = "    x = 1\n" * (limit - 1)
    table = "    p.add_argument(\n        '--x',\n        help='y',\n    )\n" * 20
    src = (
        f"def documented():\n{doc}{code}def table(p):\n{table}{code}def long():\n{code}    x = 2\n"
    )
    table_lines, long_lines = limit + 80, limit + 1  # 20 four-line calls; one line over
    assert scan.long_functions(_mod("stalwart.agent.x", src)) == {
        "table": table_lines,
        "long": long_lines,
    }
    assert scan.long_functions(_mod("stalwart.cli.x", src)) == {"long": long_lines}


def test_a_strategy_name_compared_as_a_string_is_found_outside_the_cli() -> None:
    src = """
if cfg.strategy == "elastic" or strategy in ("flash", "spare"):
    pass
if self._strategy != 'restart' and w.cause in ("restart", "shutdown"):
    pass
if strategy is Strategy.ELASTIC or strategy.resizes or mode == "flash":
    pass
"""
    assert scan.strategy_comparisons(_mod("stalwart.agent.x", src)) == {
        "cfg.strategy == 'elastic'",
        "strategy in ('flash', 'spare')",
        "self._strategy != 'restart'",
    }  # not w.cause (no strategy), not Strategy members, not an unnamed value
    assert scan.strategy_comparisons(_mod("stalwart.cli.x", src)) == set()


def test_the_scan_reads_this_checkout() -> None:
    mods = {m.rel for m in scan.modules()}
    assert {"agent/agent.py", "runtime/session.py", "logs.py"} <= mods
    assert Path(scan.SRC, "logs.py").is_file()


def test_the_agent_module_only_wires_its_parts() -> None:
    """agent/agent.py wires the parts and runs the loop (issue 14: at most 250 lines);
    a new capability of the agent is a part of its own (a detector, a policy, the node's
    health), not more lines here."""
    mod = next(m for m in scan.modules() if m.rel == "agent/agent.py")
    assert mod.lines <= 250, f"agent/agent.py has {mod.lines} lines: move the new part out"
