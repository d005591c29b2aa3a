"""Data sources: one module per source, each registered by its prefix or name (registry.py).

    embedded.py    embedded, tinyshakespeare   corpora shipped with Python / the package
    local.py       local:PATH                  .txt/.jsonl/.parquet files, read whole
    shards.py      shards:DIR                  pre-tokenized shards (torchllm.data.prepare)
    hf.py          hf:NAME, a named one        a Hugging Face dataset, streamed
A new source: a module here with a `@register`-ed Source subclass (base.py), and its line below.
"""

from torchllm.data.sources import embedded, hf, local, shards  # noqa: F401  (registers them)
from torchllm.data.sources.registry import parse_source, reads_hub

__all__ = ["parse_source", "reads_hub"]
