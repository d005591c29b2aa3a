"""One planted bug: a text patch of one file and the tests that must go red (scripts/mutation_check.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the realistic bug, in words
    path: str  # file to patch, relative to the repo root
    old: str  # exact snippet that must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail
