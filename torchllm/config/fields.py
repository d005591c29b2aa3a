"""`opt()`: a config field with its default and one-line help (the help feeds --help and docs)."""

from __future__ import annotations

from dataclasses import field


def opt(default, help: str):
    """A dataclass field with a default and a help string (lists get a default_factory)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
