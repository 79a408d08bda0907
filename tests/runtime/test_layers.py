"""The worker runtime's sub-packages are layered: each imports only those below it
(docs/architecture.md draws it). The table is exact, as ``PACKAGE_EDGES`` between the
parts is (tests/test_structure.py): an import along an edge not listed fails (a new
dependency is a reviewed decision: add it here and to the drawing), and so does a
listed edge no module uses any more. Every import counts, ``TYPE_CHECKING`` and
function-level ones too."""

from __future__ import annotations

import _structure_scan as scan
import pytest

# a sub-package of runtime/, or a top-level module of it (session, backend, __init__)
LAYERS: dict[str, frozenset[str]] = {
    "backend": frozenset(),
    "comm": frozenset({"backend"}),
    "state": frozenset({"comm"}),
    "rejoin": frozenset({"comm", "state"}),
    "replica_groups": frozenset({"comm", "state"}),
    "integrity": frozenset({"comm", "state"}),
    "steps": frozenset({"comm", "state"}),
    "elastic": frozenset({"comm", "rejoin", "state"}),
    "session": frozenset(
        {"comm", "elastic", "integrity", "rejoin", "replica_groups", "state", "steps"}
    ),
    "__init__": frozenset({"comm", "session"}),
}


def _layer(module: str) -> str:
    parts = module.split(".")  # stalwart.runtime[.<layer>[...]]
    return parts[2] if len(parts) > 2 else "__init__"


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    graph = scan.import_graph(scan.modules(), "runtime")
    found: dict[str, set[str]] = {_layer(m): set() for m in graph}
    for module, targets in graph.items():
        found[_layer(module)].update(_layer(t) for t in targets if _layer(t) != _layer(module))
    return found


def test_every_layer_is_in_the_table(edges: dict[str, set[str]]) -> None:
    assert sorted(edges) == sorted(LAYERS), "a sub-package of runtime/ came or went"


def test_a_layer_imports_only_what_the_table_allows(edges: dict[str, set[str]]) -> None:
    new = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs - LAYERS[a])
    assert not new, f"runtime/ import(s) not in LAYERS (tests/runtime/test_layers.py): {new}"


def test_the_table_lists_only_edges_in_use(edges: dict[str, set[str]]) -> None:
    unused = sorted(f"{a} -> {b}" for a, bs in LAYERS.items() for b in bs - edges.get(a, set()))
    assert not unused, f"no module imports along these: delete them from LAYERS: {unused}"


def test_the_layers_have_no_cycle() -> None:
    assert scan.cycles({a: set(bs) for a, bs in LAYERS.items()}) == []
