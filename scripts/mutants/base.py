"""One planted bug: an edit of one file and the tests that must go red (scripts/mutation_check.py).

Two forms:

    Mutant(name, what, path, old, new, tests)
        `old` must occur exactly once in the whole file `path`.
    Mutant.at(name, what, "package.module:Qual.name", old, new, tests)
        the edit is confined to one named definition -- a function, a method (`Class.method`),
        a class, or a module-level assignment (`SPEC`) -- found by the AST wherever it sits in
        the module; `old` must occur exactly once in that definition's source. A refactor that
        moves, reorders or duplicates code around it leaves the mutant applying; renaming the
        definition makes it stale by name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Stale(Exception):
    """The edit no longer applies (the message says why)."""


def definition_span(source: str, qualname: str) -> tuple[int, int]:
    """(first, last) 1-based lines of the definition `qualname` (dotted: Class.method) in
    `source`, decorators included; a top-level assignment is named by its target."""
    body = ast.parse(source).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if _defines(n, part)), None)
        if node is None:
            raise Stale(f"{qualname}: no definition {part!r} there")
        body = getattr(node, "body", [])
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first, node.end_lineno


def _defines(node: ast.AST, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, ast.AnnAssign) else [])
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the realistic bug, in words
    path: str  # file to patch, relative to the repo root
    old: str  # exact snippet that must occur exactly once (in `function`'s source, if given)
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail
    function: str = ""  # the definition the edit is confined to (Mutant.at); "" = whole file

    @classmethod
    def at(cls, name: str, what: str, target: str, old: str, new: str,
           tests: tuple[str, ...]) -> "Mutant":
        """A mutant of one definition: target = "package.module:Qual.name"."""
        module, sep, qualname = target.partition(":")
        if not sep or not qualname:
            raise ValueError(f"mutant {name}: target {target!r} is not 'package.module:name'")
        path = module.replace(".", "/")
        path = f"{path}/__init__.py" if (REPO / path).is_dir() else f"{path}.py"
        return cls(name, what, path, old, new, tuple(tests), qualname)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.function}" if self.function else self.path

    def patched(self, source: str) -> str:
        """`source` (the text of `path`) with the bug planted; Stale when it does not apply."""
        if not self.function:
            count = source.count(self.old)
            if count != 1:
                raise Stale(f"its snippet occurs {count} times in {self.path} "
                            "(must be exactly once)")
            return source.replace(self.old, self.new)
        first, last = definition_span(source, self.function)
        lines = source.splitlines(keepends=True)
        head, body, tail = lines[:first - 1], "".join(lines[first - 1:last]), lines[last:]
        count = body.count(self.old)
        if count != 1:
            raise Stale(f"its snippet occurs {count} times in {self.where} (must be exactly "
                        "once)")
        return "".join(head) + body.replace(self.old, self.new) + "".join(tail)
