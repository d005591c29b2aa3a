"""data.dataset = "embedded": CPython's bundled docs, tokenized in memory (the default)."""

from __future__ import annotations

from torchllm.data.embedded import embedded_documents
from torchllm.data.kinds.base import CorpusKind
from torchllm.data.kinds.registry import register


@register
class Embedded(CorpusKind):
    names = ("embedded",)
    usage, order = "embedded", 0

    def texts(self):
        return iter(embedded_documents())
