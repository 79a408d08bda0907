"""The script's own modules in the zygote: which of them it may import before it forks.

Why: a replacement worker runs the script from its first line, so it imports the
script's own modules again (``from model import GPT``, a ``torchtitan/`` package checked
out beside the script): a real script's local package took longer to import than torch
itself. The zygote preloads them as it preloads installed packages (agent/processes/_preload.py),
but a module of the script's own is code nobody vetted, so it is imported only when
reading it shows that importing it runs nothing but definitions.

What is preloaded: the script's top-level imports that resolve to a module in the
script's directory (what ``python script.py`` finds first), when that module and every
module of the script's directory it imports in turn (its packages' ``__init__`` files
included) pass :func:`verdict`: at module level (and in class bodies) only imports,
definitions, assignments, docstrings, ``if``/``try`` around those, and an ``if __name__
== "__main__":`` block (not run). A call is allowed only as a decorator or as one of a
few constructors without effects (``getLogger``, ``TypeVar``, ``field``...): a module
that calls anything else at import (``torch.manual_seed``, ``print``, reading a file,
building a model) is skipped, with one debug line, and the worker imports it itself as
without stalwart. A module whose import fails is skipped the same way (and forgotten, so
the worker's own import reports the error).

Why file stamps: the zygote lives as long as the run, and a module edited after it
started would be the old code in every replacement forked from it; a worker whose
preloaded local modules changed on disk (size or mtime) drops them all before the script
runs, and imports the edited files.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from dataclasses import dataclass, field

__all__ = ["LocalPreload", "forget_changed", "preload_local", "verdict"]

_MAX_FILES = 400  # a local tree larger than this is not read (nor preloaded)
_HARMLESS_CALLS = frozenset(
    {
        "getLogger",
        "TypeVar",
        "ParamSpec",
        "NewType",
        "namedtuple",
        "field",
        "dataclass",
        "frozenset",
        "set",
        "dict",
        "tuple",
        "list",
        "object",
        "property",
        "staticmethod",
        "classmethod",
        "cast",
        "compile",  # re.compile
    }
)

_stamps: dict[str, tuple[str, int, int]] = {}  # module -> (file, mtime_ns, size), this zygote's


@dataclass
class LocalPreload:
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "module: why", one debug line each


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _calls(node: ast.AST) -> str:
    """The first call ``node`` runs when evaluated (not inside a lambda), or ""."""
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, ast.Call) and _call_name(n) not in _HARMLESS_CALLS:
            return f"line {n.lineno}: calls {ast.unparse(n.func)}()"
        todo.extend(ast.iter_child_nodes(n))
    return ""


def _is_main_guard(node: ast.If) -> bool:
    t = node.test
    return (
        isinstance(t, ast.Compare)
        and isinstance(t.left, ast.Name)
        and t.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators)
    )


def _body(body: list[ast.stmt]) -> str:
    """Why running ``body`` at import would do more than define things, or ""."""
    for node in body:
        why = ""
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            why = next((w for a in _defaults(node.args) if (w := _calls(a))), "")
        elif isinstance(node, ast.ClassDef):
            why = next((w for b in node.bases if (w := _calls(b))), "") or _body(node.body)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            why = _calls(node.value) if node.value is not None else ""
        elif isinstance(node, ast.Expr):
            why = _calls(node.value)  # a docstring passes, a call does not
        elif isinstance(node, ast.If):
            if _is_main_guard(node):
                continue
            why = _calls(node.test) or _body(node.body) or _body(node.orelse)
        elif isinstance(node, ast.Try):
            why = _body(node.body) or _body(node.orelse) or _body(node.finalbody)
            why = why or next((w for h in node.handlers if (w := _body(h.body))), "")
        else:
            why = f"line {node.lineno}: runs a {type(node).__name__.lower()} statement"
        if why:
            return why
    return ""


def _defaults(args: ast.arguments) -> list[ast.expr]:
    return [*args.defaults, *(d for d in args.kw_defaults if d is not None)]


def _file_of(root: str, name: str) -> list[str]:
    """The files ``import name`` runs from ``root`` (packages' ``__init__`` first); empty
    when ``name`` is not a module under ``root``."""
    parts, files, here = name.split("."), [], root
    for i, part in enumerate(parts):
        pkg = os.path.join(here, part, "__init__.py")
        if os.path.isfile(pkg):
            files.append(pkg)
            here = os.path.join(here, part)
        elif i == len(parts) - 1 and os.path.isfile(os.path.join(here, part + ".py")):
            files.append(os.path.join(here, part + ".py"))
        else:
            return []
    return files


def _import_nodes(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs at import time (not those inside functions)."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.ClassDef):
            out += _import_nodes(node.body)
        elif isinstance(node, ast.If) and not _is_main_guard(node):
            out += _import_nodes(node.body) + _import_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            out += _import_nodes(node.body) + _import_nodes(node.orelse)
            for h in node.handlers:
                out += _import_nodes(h.body)
    return out


def _imports(tree: ast.Module, path: str, root: str) -> list[str]:
    """Dotted names of the modules under ``root`` that the module at ``path`` imports
    (absolute and relative, ``from pkg import sub`` reading ``pkg.sub`` when it is one)."""
    rel = os.path.relpath(os.path.dirname(path), root)
    package = [] if rel == "." else rel.split(os.sep)
    out: list[str] = []
    for node in _import_nodes(tree.body):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if mod:
                out.append(mod)
            out += [f"{mod}.{a.name}" if mod else a.name for a in node.names if a.name != "*"]
    return [m for m in out if m and _file_of(root, m)]


def verdict(name: str, root: str) -> str:
    """Why importing ``name`` from ``root`` may do more than define things (the first
    reason found, with its file and line), or "" when it and all it imports from
    ``root`` pass (module doc)."""
    seen: set[str] = set()
    todo = list(_file_of(root, name))
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if len(seen) > _MAX_FILES:
            return f"imports over {_MAX_FILES} files of the script's directory"
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError) as err:
            return f"{os.path.relpath(path, root)}: unreadable ({type(err).__name__})"
        why = _body(tree.body)
        if why:
            return f"{os.path.relpath(path, root)} {why}"
        for mod in _imports(tree, path, root):
            todo += _file_of(root, mod)
    return ""


def preload_local(items: list[tuple[str, tuple[str, ...]]], script: str) -> LocalPreload:
    """Import the modules of ``items`` (the script's top-level imports) that live in the
    script's directory and pass :func:`verdict`; stamp every module of that directory
    then loaded (:func:`forget_changed`). Runs in the zygote, after the installed ones."""
    root = os.path.realpath(os.path.dirname(os.path.abspath(script)))
    res = LocalPreload()
    loaded = set(sys.modules)
    sys.path.insert(0, root)
    try:
        for mod, _names in items:
            if not _file_of(root, mod) or mod in sys.modules:
                continue
            why = verdict(mod, root)
            if why:
                res.skipped.append(f"{mod}: {why}")
                continue
            before = set(sys.modules)
            try:
                importlib.import_module(mod)
                res.imported.append(mod)
            except BaseException as err:  # SystemExit too: never end the zygote
                first = (str(err).splitlines() or [""])[0]
                res.skipped.append(f"{mod}: import failed: {type(err).__name__}: {first}"[:200])
                for name in set(sys.modules) - before:
                    sys.modules.pop(name, None)
    finally:
        sys.path.remove(root)
    for name in set(sys.modules) - loaded:
        path = getattr(sys.modules[name], "__file__", None)
        if path and os.path.realpath(path).startswith(root + os.sep):
            try:
                st = os.stat(path)
            except OSError:
                continue
            _stamps[name] = (path, st.st_mtime_ns, st.st_size)
    return res


def forget_changed() -> list[str]:
    """In a forked worker, before the script runs: when a preloaded local module's file
    changed since the zygote imported it, drop every preloaded local module (they refer
    to one another), so the script imports the files as they are now. Returns them."""
    for path, mtime, size in _stamps.values():
        try:
            st = os.stat(path)
            same = (st.st_mtime_ns, st.st_size) == (mtime, size)
        except OSError:
            same = False
        if not same:
            for name in _stamps:
                sys.modules.pop(name, None)
            return list(_stamps)
    return []
