"""The AST scan behind tests/test_structure.py: what each structure rule finds in src/.

Kept apart from the test so that the rules can be read (and run by hand:
``.venv/bin/python tests/_structure_scan.py`` prints today's findings) without the
allowlist in the way.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "stalwart"
# issue 32: limits that serve reading (a module around 600 lines, a function around 80),
# not limits the code is cut to fit
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
CYCLE_PACKAGES = ("agent", "runtime")
# the package that holds every use of another project's internals (rule g)
SEAM = "compat"
# underscore names of the standard library that its documentation makes public
_DOCUMENTED = frozenset({"os._exit", "sys._getframe"})

# argparse calls that make a CLI argument table: in cli/ their lines do not count towards
# a function's length (the house rule exempts "the CLI's argument tables")
_TABLE_CALLS = frozenset(
    {
        "add_argument",
        "add_argument_group",
        "add_mutually_exclusive_group",
        "add_parser",
        "add_subparsers",
        "set_defaults",
    }
)


def _private(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` (a dunder: ``__version__``,
    ``__class__``) is the language's, public."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Module:
    """One source file of src/stalwart."""

    path: Path
    name: str  # dotted: stalwart.agent.strategies._elastic
    tree: ast.Module
    lines: int

    @property
    def rel(self) -> str:
        """The path as allowlist entries spell it: ``agent/strategies/_elastic.py``."""
        return self.path.relative_to(SRC).as_posix()

    @property
    def part(self) -> str:
        """The part (a package of DESIGN.md) the module belongs to; a top-level module
        (errors.py, logs.py) is a part of its own, as :func:`_part_of` reads it."""
        return _part_of(self.name)

    @property
    def package(self) -> str:
        """The dotted package relative imports resolve against."""
        if self.path.name == "__init__.py":
            return self.name
        return self.name.rpartition(".")[0]


def modules() -> list[Module]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        text = path.read_text()
        found.append(Module(path, ".".join(parts), ast.parse(text, str(path)), text.count("\n")))
    return found


@functools.cache
def _walk(node: ast.AST) -> tuple[ast.AST, ...]:
    """``ast.walk(node)``, walked once per node: the rules walk each module's tree many
    times (the import graph alone asks every module's imports once per module)."""
    return tuple(ast.walk(node))


def _part_of(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "stalwart"


@dataclass(frozen=True)
class Import:
    """One imported stalwart module (``target``), with the names taken from it."""

    target: str
    names: tuple[str, ...]
    node: ast.AST


def imports(mod: Module, known: set[str]) -> Iterator[Import]:
    """Every import of a stalwart module anywhere in ``mod`` (module level, under
    ``TYPE_CHECKING``, inside functions) and every ``importlib.import_module`` of a
    constant name. ``from pkg import sub`` where ``sub`` is a module counts as an import
    of ``pkg.sub``."""
    for node in _walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "stalwart":
                    yield Import(alias.name, (), node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = mod.package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "stalwart":
                continue
            plain = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield Import(sub, (), node)
                else:
                    plain.append(alias.name)
            if plain:
                yield Import(base, tuple(plain), node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == "stalwart"
        ):
            yield Import(node.args[0].value, (), node)


def private_imports(mod: Module, known: set[str]) -> set[str]:
    """Rule (a): ``stalwart.x._y`` (a private module) or ``_z`` (a private name) of
    another part imported by ``mod``. Entry: the dotted private target."""
    found = set()
    for imp in imports(mod, known):
        if _part_of(imp.target) == mod.part:
            continue
        if any(_private(p) for p in imp.target.split(".")):
            found.add(imp.target)
        found.update(f"{imp.target}.{n}" for n in imp.names if _private(n))
    return found


def _own_private_names(tree: ast.Module) -> set[str]:
    """The private attribute names that classes defined in this module give their
    objects: ``self._x = ...`` / ``cls._x = ...`` in their methods, ``_x`` assigned or
    annotated in their bodies, and their ``_methods``. An access ``other._x`` with such
    a name is taken to be on an object of this module's own class (``__eq__``'s
    ``other``, a factory's ``obj = cls(); obj._x = ...``): the module that defines a
    class may touch its objects' internals."""
    names = set()
    for cls in (n for n in _walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
            elif isinstance(item, ast.Assign):
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in _walk(cls):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for t in targets:
                for sub in _walk(t):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls")
                    ):
                        names.add(sub.attr)
    return {n for n in names if _private(n)}


def _foreign_modules(tree: ast.Module) -> set[str]:
    """Names bound to modules from outside stalwart (``import os``, ``import torch.distributed
    as dist``): their underscore attributes are not another *object*'s internals (rule
    b) but a dependency's, which rule (g) confines to src/stalwart/compat/."""
    names = set()
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "stalwart":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if (node.module or "").split(".")[0] == "stalwart":
                continue
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(expr: ast.expr) -> ast.expr:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return expr


def _own(expr: ast.expr) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)``: the object whose method runs."""
    if isinstance(expr, ast.Name):
        return expr.id in ("self", "cls")
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
        if expr.func.id == "super":
            return True
        if expr.func.id == "type" and len(expr.args) == 1:
            return _own(expr.args[0])
    return False


def foreign_private_attributes(mod: Module) -> set[str]:
    """Rule (b): ``obj._x`` read or written (or ``getattr/setattr/hasattr/delattr(obj,
    "_x")``) where ``obj`` is not the running method's own object, ``_x`` is not a
    private name of a class of this module, and ``obj`` is not a module from outside
    stalwart. Entry: ``<obj as written>._x``."""
    own = _own_private_names(mod.tree)
    foreign = _foreign_modules(mod.tree)
    found = set()
    for node in _walk(mod.tree):
        if isinstance(node, ast.Attribute):
            value, attr = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            value, attr = node.args[0], node.args[1].value
        else:
            continue
        if not _private(attr) or _own(value) or attr in own:
            continue
        root = _root(value)
        if isinstance(root, ast.Name) and root.id in foreign:
            continue
        found.add(f"{ast.unparse(value)}.{attr}")
    return found


def _foreign_private_import(name: str) -> bool:
    return name.split(".")[0] != "stalwart" and any(_private(p) for p in name.split("."))


def dependency_internals(mod: Module) -> set[str]:
    """Rule (g): another project's private name used outside the seam (compat/): an
    import of a module from outside stalwart whose dotted name has a private part
    (``torch._C._distributed_c10d``, also through ``importlib.import_module("...")``), a
    private name imported from one (``from torch.distributed.distributed_c10d import
    _world``), and a private attribute of a name bound to one (``c10d._world``,
    ``getattr(threading, "_shutdown")``), except the few the standard library documents
    (``os._exit``, ``sys._getframe``). A private attribute of another project's *object*
    (``ddp._update_process_group``) is rule (b)'s finding, allowed only in compat/
    (tests/test_structure.py's ``DEPENDENCY_INTERNALS``). Entry: the dotted name."""
    if mod.part == SEAM:
        return set()
    foreign = _foreign_modules(mod.tree)
    found = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if _foreign_private_import(a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level:
            base = node.module or ""
            if base.split(".")[0] == "stalwart":
                continue
            if _foreign_private_import(base):
                found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _private(a.name))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            first, func = node.args[0].value, node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "import_module"
                and isinstance(first, str)
                and _foreign_private_import(first)
            ):
                found.add(first)
        target = _private_attribute(node)
        if target is not None:
            value, attr = target
            root = _root(value)
            name = f"{ast.unparse(value)}.{attr}"
            if isinstance(root, ast.Name) and root.id in foreign and name not in _DOCUMENTED:
                found.add(name)
    return found


def _private_attribute(node: ast.AST) -> tuple[ast.expr, str] | None:
    """``obj._x`` or ``getattr/setattr/hasattr/delattr(obj, "_x")``: (obj, "_x")."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        return node.value, node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and _private(node.args[1].value)
    ):
        return node.args[0], node.args[1].value
    return None


def import_graph(mods: list[Module], package: str) -> dict[str, set[str]]:
    """Edges between the modules of ``stalwart.<package>``, every import counted (a
    ``TYPE_CHECKING`` or function-level import is still a dependency: it only hides
    the cycle from the interpreter, not from a reader). The package's own
    ``__init__`` is a node like any module."""
    known = {m.name for m in mods}
    prefix = f"stalwart.{package}"
    inside = [m for m in mods if m.name == prefix or m.name.startswith(prefix + ".")]
    graph: dict[str, set[str]] = {m.name: set() for m in inside}
    for m in inside:
        for imp in imports(m, known):
            if imp.target in graph and imp.target != m.name:
                graph[m.name].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


@dataclass
class _Length(ast.NodeVisitor):
    """Rule (e): functions longer than the limit, by qualified name."""

    in_cli: bool
    found: dict[str, int] = field(default_factory=dict)
    _scope: list[str] = field(default_factory=list)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        n = function_lines(node, in_cli=self.in_cli)
        if n > MAX_FUNCTION_LINES:
            self.found[".".join(self._scope)] = n
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, *, in_cli: bool) -> int:
    """Lines from ``def`` to the function's last line, less its docstring (a docstring
    says why; the limit is on code) and, in cli/, less the lines of argparse table
    calls (``p.add_argument(...)``)."""
    assert node.end_lineno is not None
    skipped: set[int] = set()
    body = node.body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        skipped.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    if in_cli:
        for sub in _walk(node):
            if (
                isinstance(sub, ast.Expr)
                and isinstance(sub.value, ast.Call)
                and isinstance(sub.value.func, ast.Attribute)
                and sub.value.func.attr in _TABLE_CALLS
            ):
                skipped.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return node.end_lineno - node.lineno + 1 - len(skipped)


def long_functions(mod: Module) -> dict[str, int]:
    v = _Length(in_cli=mod.part == "cli")
    v.visit(mod.tree)
    return v.found


STRATEGY_NAMES = frozenset({"restart", "flash", "spare", "elastic", "async"})


def _names_strategy(expr: ast.expr) -> bool:
    """``strategy``, ``cfg.strategy``, ``self._strategy``, ``rp.strategy``: a value named
    for the strategy (the last name of the expression says it)."""
    if isinstance(expr, ast.Name):
        return "strategy" in expr.id.lower()
    if isinstance(expr, ast.Attribute):
        return "strategy" in expr.attr.lower()
    return False


def _strategy_literal(expr: ast.expr) -> bool:
    """A strategy's name, or a tuple/list/set holding one, written as a string."""
    if isinstance(expr, ast.Constant):
        return expr.value in STRATEGY_NAMES
    if isinstance(expr, ast.Tuple | ast.List | ast.Set):
        return any(_strategy_literal(e) for e in expr.elts)
    return False


def strategy_comparisons(mod: Module) -> set[str]:
    """Rule (f): a value named for the strategy compared (``==``, ``!=``, ``in``, ``not
    in``) with a strategy's name written as a string, outside cli/ (the CLI parses the
    name; everything after it asks the parsed value)."""
    if mod.part == "cli":
        return set()
    found = set()
    for node in _walk(mod.tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(map(_names_strategy, operands)) and any(map(_strategy_literal, operands)):
            found.add(ast.unparse(node))
    return found


def package_edges(mods: list[Module]) -> dict[str, set[str]]:
    """Which part imports which (:attr:`Module.part`: a package of src/stalwart, or a
    top-level module such as ``errors``), every import counted as in
    :func:`import_graph`. Every part is a key, one that imports no other part too."""
    known = {m.name for m in mods}
    graph: dict[str, set[str]] = {m.part: set() for m in mods}
    for m in mods:
        for imp in imports(m, known):
            target = _part_of(imp.target)
            if target != m.part:
                graph[m.part].add(target)
                graph.setdefault(target, set())
    return graph


def subpackage_edges(mods: list[Module], package: str) -> dict[str, set[str]]:
    """Which sub-package of ``stalwart.<package>`` imports which (``agent.detection`` ->
    ``agent.processes``), every import counted as in :func:`import_graph`; the package's
    top-level modules (agent.py, config.py) are no sub-package and are left out."""
    known = {m.name for m in mods}
    prefix = f"stalwart.{package}."

    def sub(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix) :].split(".")
        return rest[0] if len(rest) > 1 or Path(SRC, package, rest[0]).is_dir() else None

    graph: dict[str, set[str]] = {}
    for m in mods:
        a = sub(m.name)
        if a is None:
            continue
        graph.setdefault(a, set())
        for imp in imports(m, known):
            b = sub(imp.target)
            if b is not None and b != a:
                graph[a].add(b)
                graph.setdefault(b, set())
    return graph


def findings() -> dict[str, set[str]]:
    """Every rule's findings as allowlist entries (``<module path>: <what>``)."""
    mods = modules()
    known = {m.name for m in mods}
    out: dict[str, set[str]] = {
        "private_import": set(),
        "foreign_private_attribute": set(),
        "import_cycle": set(),
        "long_module": set(),
        "long_function": set(),
        "strategy_comparison": set(),
        "dependency_internal": set(),
    }
    for m in mods:
        out["private_import"].update(f"{m.rel}: {t}" for t in private_imports(m, known))
        out["foreign_private_attribute"].update(
            f"{m.rel}: {a}" for a in foreign_private_attributes(m)
        )
        if m.lines > MAX_MODULE_LINES:
            out["long_module"].add(m.rel)
        out["long_function"].update(f"{m.rel}: {f}" for f in long_functions(m))
        out["strategy_comparison"].update(f"{m.rel}: {c}" for c in strategy_comparisons(m))
        out["dependency_internal"].update(f"{m.rel}: {n}" for n in dependency_internals(m))
    for package in CYCLE_PACKAGES:
        for comp in cycles(import_graph(mods, package)):
            short = [c.removeprefix(f"stalwart.{package}").lstrip(".") or "__init__" for c in comp]
            out["import_cycle"].add(f"{package}: {', '.join(short)}")
    return out


if __name__ == "__main__":
    for rule, entries in findings().items():
        print(f"# {rule}: {len(entries)}")
        for e in sorted(entries):
            print(f'    "{e}",')
    sys.exit(0)
