"""Corpora that need no download: CPython's bundled documentation (`pydoc_data.topics`, the
default) and tiny Shakespeare, shipped in `torchllm/data/assets/` (MIT; licence beside it).

Every CPython ships the first: ~465 KB of English prose about Python, one document per help
topic. The second is karpathy/char-rnn's 1.1 MB text, one document, as nanoGPT reads it.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
TINY_SHAKESPEARE = ASSETS / "tinyshakespeare.txt"


def embedded_documents() -> list[str]:
    """The documents in a fixed order (sorted by topic name), so runs are reproducible."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def tiny_shakespeare() -> list[str]:
    """Tiny Shakespeare as one document (as `local:` reads a .txt file)."""
    return [TINY_SHAKESPEARE.read_text(encoding="utf-8")]
