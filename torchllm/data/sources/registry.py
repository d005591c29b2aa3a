"""The data-source registry: a `data.dataset` prefix (or bare name) maps to its source's class.

A new source is one module under torchllm/data/sources/ with a `@register`-ed Source subclass
and one import line in sources/__init__.py; nothing else in the tree names sources. How a
source's rows become windows (text, or conversations after a `chat:` prefix) is the packing's
business (torchllm/data/packing/), chosen by config.job_config.data_packing.
"""

from __future__ import annotations

from torchllm.config.job_config import ConfigError, data_packing

PREFIXES: dict[str, type] = {}  # "local" -> LocalFiles, for data.dataset = "local:PATH"
NAMES: dict[str, type] = {}  # "embedded" -> Embedded, "fineweb_edu" -> HFStream


def register(cls):
    """Class decorator: `cls.prefix` and every name in `cls.names` now parse to `cls`."""
    for table, keys in ((PREFIXES, [cls.prefix] if cls.prefix else []), (NAMES, cls.names)):
        for key in keys:
            if key in table:
                raise ValueError(f"data source {key!r} is registered twice "
                                 f"({table[key].__name__}, {cls.__name__})")
            table[key] = cls
    return cls


def parse_source(dcfg, key: str = "data.dataset", more_usage: tuple[str, ...] = ()):
    """The source object of `dcfg.dataset` (a source spec), checked without reading data.

    The launcher's pre-flight check and the trainer both call this, so they cannot disagree.
    `more_usage`: what else a data.dataset may be (the packings' forms), for the unknown-spec
    error.
    """
    spec = dcfg.dataset
    if spec in NAMES:
        return NAMES[spec].parse(dcfg, spec)
    prefix, sep, location = spec.partition(":")
    if sep and prefix in PREFIXES:
        return PREFIXES[prefix].parse(dcfg, location)
    kinds = sorted({cls for cls in [*PREFIXES.values(), *NAMES.values()]},
                   key=lambda c: c.order)
    usage = ", ".join(f"'{u}'" for u in [*(c.usage for c in kinds), *more_usage])
    named = ", ".join(sorted(n for n, c in NAMES.items() if c.usage != n))
    raise ConfigError(f"{key} = {spec!r} is not known; use one of {usage}, or a named dataset "
                      f"({named})", key)


def rows_spec(location: str) -> str:
    """The source spec that reads a packing's LOCATION (chat:LOCATION): a Hugging Face dataset
    (hf:NAME), streamed; anything else is local files."""
    return location if location.startswith("hf:") else f"local:{location}"


def source_spec(spec: str) -> str:
    """The source part of a data.dataset value: itself, or the source reading the rows after a
    packing prefix (chat:hf:NAME -> hf:NAME, chat:PATH -> local:PATH)."""
    packing, location = data_packing(spec)
    return spec if location is None else rows_spec(location)


def source_class(spec: str):
    """The class of the source a spec reads, from its prefix or name alone (no checks, nothing
    read), or None for an unknown spec."""
    spec = source_spec(spec)
    if spec in NAMES:
        return NAMES[spec]
    prefix, sep, _ = spec.partition(":")
    return PREFIXES.get(prefix) if sep else None


def reads_hub(spec: str) -> bool:
    """Whether a spec reads a Hugging Face dataset (by name or split: data.hf_subset and
    hf_split apply), or is not known (shown rather than hidden). By its source's class alone:
    for summaries of a finished run too, whose files may be gone."""
    cls = source_class(spec)
    return cls is None or cls.splits_by_name
