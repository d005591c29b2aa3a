"""Shared test builders (tests/builders/docs.py): imported by the test modules that use them."""

from __future__ import annotations

import re

from conftest import REPO, tiny_args


def documented_tags() -> list[re.Pattern]:
    """The tags of docs/metrics.md's table (`<group>` matching one path part)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    tags = re.findall(r"^\| `([a-z_]+/[^`]+)` \|", text, re.M)
    return [re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(t).replace(r"\<", "<")
                              .replace(r"\>", ">")) + "$") for t in tags]
