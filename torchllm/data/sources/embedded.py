"""data.dataset = "embedded" or "tinyshakespeare": corpora that need no download, tokenized in
memory. "embedded" (the default) is CPython's bundled documentation (`pydoc_data.topics`):
every CPython ships it, ~465 KB of English prose about Python, one document per help topic.
"tinyshakespeare" is karpathy/char-rnn's 1.1 MB text, one document as nanoGPT reads it, shipped
in `torchllm/data/assets/` (MIT; licence beside it).
"""

from __future__ import annotations

from pathlib import Path

from torchllm.data.sources.base import CorpusSource
from torchllm.data.sources.registry import register

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TINY_SHAKESPEARE = ASSETS / "tinyshakespeare.txt"


def embedded_documents() -> list[str]:
    """The documents in a fixed order (sorted by topic name), so runs are reproducible."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def tiny_shakespeare() -> list[str]:
    """Tiny Shakespeare as one document (as `local:` reads a .txt file)."""
    return [TINY_SHAKESPEARE.read_text(encoding="utf-8")]


@register
class Embedded(CorpusSource):
    names = ("embedded",)
    usage, order = "embedded", 0

    def texts(self):
        return iter(embedded_documents())


@register
class TinyShakespeare(CorpusSource):
    names = ("tinyshakespeare",)
    usage, order = "tinyshakespeare", 0

    def texts(self):
        return iter(tiny_shakespeare())
