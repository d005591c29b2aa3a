"""Shared test builders (tests/builders/docs.py): imported by the test modules that use them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO, tiny_args


def documented_tags() -> list[re.Pattern]:
    """The tags of docs/metrics.md's table (`<group>` matching one path part)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    tags = re.findall(r"^\| `([a-z_]+/[^`]+)` \|", text, re.M)
    return [re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(t).replace(r"\<", "<")
                              .replace(r"\>", ">")) + "$") for t in tags]


SHELL = {"", "sh", "bash", "shell"}  # a code block's languages that hold commands
NOT_COMMANDS = {  # (document, first line of a plain ``` block that is not shell) -> what it is
    ("checkpointing.md", "<dump_folder>/"): "a folder layout",
}


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each shell code block."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body = lines[i + 1 : end]
        first = body[0] if body else ""
        known = any(path.name == doc and first.startswith(prefix)
                    for doc, prefix in NOT_COMMANDS)
        if m.group(1) in SHELL and not known:
            out.append((i + 2, "\n".join(body)))
        i = end + 1
    return out


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command without comments) of each command of a document."""
    out = []
    for start, block in shell_blocks(path):
        pending, first = "", None
        for n, line in enumerate(block.splitlines(), start):
            if not line.strip() or (not pending and line.lstrip().startswith("#")):
                continue
            first = n if not pending else first
            pending += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") \
                else line
            if not line.rstrip().endswith("\\"):
                out.append((first, shlex.join(shlex.split(pending, comments=True))))
                pending = ""
    return out
