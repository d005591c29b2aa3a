"""The data-kind registry: a `data.dataset` prefix (or bare name) maps to its kind's class.

A new kind is one module under torchllm/data/kinds/ with a `@register`-ed DataKind subclass and
one import line in kinds/__init__.py; nothing else in the tree names kinds.
"""

from __future__ import annotations

from torchllm.config.job_config import ConfigError

PREFIXES: dict[str, type] = {}  # "local" -> LocalFiles, for data.dataset = "local:PATH"
NAMES: dict[str, type] = {}  # "embedded" -> Embedded, "fineweb_edu" -> HFStream


def register(cls):
    """Class decorator: `cls.prefix` and every name in `cls.names` now parse to `cls`."""
    for table, keys in ((PREFIXES, [cls.prefix] if cls.prefix else []), (NAMES, cls.names)):
        for key in keys:
            if key in table:
                raise ValueError(f"data kind {key!r} is registered twice ({table[key].__name__}, "
                                 f"{cls.__name__})")
            table[key] = cls
    return cls


def parse_source(dcfg, key: str = "data.dataset"):
    """The kind object of `dcfg.dataset` (one source), its spec checked without reading data.

    The launcher's pre-flight check and the trainer both call this, so they cannot disagree.
    """
    spec = dcfg.dataset
    if spec in NAMES:
        return NAMES[spec].parse(dcfg, spec)
    prefix, sep, location = spec.partition(":")
    if sep and prefix in PREFIXES:
        return PREFIXES[prefix].parse(dcfg, location)
    kinds = sorted({cls for cls in [*PREFIXES.values(), *NAMES.values()]},
                   key=lambda c: c.order)
    usage = ", ".join(f"'{c.usage}'" for c in kinds)
    named = ", ".join(sorted(n for n, c in NAMES.items() if c.usage != n))
    raise ConfigError(f"{key} = {spec!r} is not known; use one of {usage}, or a named dataset "
                      f"({named})", key)


def kind_class(spec: str):
    """The kind class a spec names, from its prefix or name alone (no checks, nothing read), or
    None for an unknown spec."""
    if spec in NAMES:
        return NAMES[spec]
    prefix, sep, _ = spec.partition(":")
    return PREFIXES.get(prefix) if sep else None


def reads_conversations(dcfg) -> bool:
    """Whether a data config trains on conversations (data.dataset, or with [[data.sources]]
    any of them, is a chat kind), by the specs alone: for finished runs, nothing is read."""
    specs = [s.dataset for s in dcfg.sources] or [dcfg.dataset]
    return any("chat" in spec_reads(str(spec)) for spec in specs)


def spec_reads(spec: str) -> set[str]:
    """What a spec reads, by its kinds' classes alone: "chat" (conversations) and/or "hub" (a
    Hugging Face dataset, by name or split), following kinds that wrap another spec (chat:hf:...).
    For summaries and exports of a finished run, whose files may be gone: nothing is checked."""
    reads, cls = set(), kind_class(spec)
    while cls is not None:
        reads |= {"chat"} if cls.chat else set()
        reads |= {"hub"} if cls.splits_by_name else set()
        spec = spec.partition(":")[2] if cls.wraps else ""
        cls = kind_class(spec) if spec else None
    return reads

