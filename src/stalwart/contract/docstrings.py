"""The docstrings of a dataclass's fields, read from its source.

Python keeps no attribute docstring at run time (the string after ``x: int = 0`` is an
expression statement the compiler drops), so the text is read back from the class's
source with :mod:`ast`. Why bother: a field's docstring is its one description, and
`stalwart run` shows it as the help of the field's flag (cli/_knob_flags.py), so the
flag's help and the contract's documentation cannot drift apart.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap

__all__ = ["field_docs"]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring, whitespace collapsed to single spaces (a field with
    none is left out)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs
