"""data.dataset = "embedded" (CPython's bundled docs, the default) or "tinyshakespeare" (shipped
with the package): corpora that need no download, tokenized in memory."""

from __future__ import annotations

from torchllm.data.embedded import embedded_documents, tiny_shakespeare
from torchllm.data.kinds.base import CorpusKind
from torchllm.data.kinds.registry import register


@register
class Embedded(CorpusKind):
    names = ("embedded",)
    usage, order = "embedded", 0

    def texts(self):
        return iter(embedded_documents())


@register
class TinyShakespeare(CorpusKind):
    names = ("tinyshakespeare",)
    usage, order = "tinyshakespeare", 0

    def texts(self):
        return iter(tiny_shakespeare())
