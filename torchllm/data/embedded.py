"""The embedded default corpus: CPython's bundled documentation (`pydoc_data.topics`).

Every CPython ships it, so the out-of-the-box run needs no download: ~465 KB of English prose
about Python, one document per help topic.
"""

from __future__ import annotations


def embedded_documents() -> list[str]:
    """The documents in a fixed order (sorted by topic name), so runs are reproducible."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]
