"""Data kinds: every `data.dataset` value is one object behind one small interface (base.py).

    kind = parse_data(job_config.data)   # one source, or a Mixture of [[data.sources]]
    kind.tokenizer_source()              # which source a data.tokenizer = 'auto' comes from
    kind.batches(ctx)                    # (endless training batches, validation windows)

Registered kinds (prefix or name -> class, registry.py):
    embedded            Embedded     CPython's bundled docs (embedded.py)
    tinyshakespeare     TinyShakespeare  tiny Shakespeare, shipped with the package (embedded.py)
    local:PATH          LocalFiles   .txt/.jsonl/.parquet files, tokenized in memory (local.py)
    shards:DIR          Shards       pre-tokenized shards from torchllm.data.prepare (shards.py)
    hf:NAME, <named>    HFStream     a Hugging Face dataset, streamed (hf.py)
    chat:PATH|hf:NAME   Chat         conversations, assistant-only loss (chat.py)
Adding a kind: a module here with a `@register`-ed DataKind subclass, and its import below.
"""

from torchllm.data.kinds import chat, embedded, hf, local, shards  # noqa: F401  (registers them)
from torchllm.data.kinds.base import Context, DataKind
from torchllm.data.kinds.mixture import Mixture
from torchllm.data.kinds.registry import NAMES, PREFIXES, parse_source, register


def parse_data(dcfg) -> DataKind:
    """The data config's source: a Mixture of data.sources, or data.dataset's kind."""
    return Mixture.parse(dcfg) if dcfg.sources else parse_source(dcfg)


def check_data(job_config) -> None:
    """Parse every dataset spec of a job config (the launcher's pre-flight check)."""
    import copy

    parse_data(job_config.data).preflight()
    if job_config.validation.dataset:
        other = copy.copy(job_config.data)
        other.dataset, other.sources = job_config.validation.dataset, []
        parse_source(other, "validation.dataset").preflight()


__all__ = ["Context", "DataKind", "Mixture", "NAMES", "PREFIXES", "check_data", "parse_data",
           "parse_source", "register"]
