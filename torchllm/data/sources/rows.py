"""Reading rows through `datasets`' streaming reader: what the sources that read rows share
(local files, sources/local.py; Hugging Face datasets, sources/hf.py).

    load_streaming      a streaming `datasets.IterableDataset`, opened and checked
    stream_texts        every row's value of one column, in order
"""

from __future__ import annotations

from typing import Iterator

from torchllm.config.job_config import ConfigError


def import_datasets(what: str):
    """The optional `datasets` package, or a ConfigError saying what needed it and what works
    without it (an offline GPU image may lack it)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{what} needs the `datasets` package, which is not installed; install it, or use "
            "data.dataset = 'shards:DIR' (prepared with `python -m torchllm.data.prepare` where "
            "datasets is installed) or 'embedded'", "data.dataset",
        ) from None
    return datasets


def load_streaming(path: str, kwargs: dict, where: str, column: str, subset=None,
                   split: str = "train", local=None):
    """(`datasets.load_dataset(path, streaming=True, **kwargs)`, column), checked: it opens, it
    has a row, and the row has `column`. `where` names the source in errors. `local`: local
    files' reading (sources/local.py's LocalReading): `unreadable()` names a file that cannot
    be read, `rows(ds)` reads the rows naming one.

    Local files go through the same streaming reader as the Hub, so no Arrow cache is written
    and HF_DATASETS_OFFLINE=1 works.
    """
    datasets = import_datasets(f"data.dataset = {where!r}")
    offline = False
    if local is None:  # a Hub dataset: reachable within seconds, or offline mode now
        from torchllm.hub import prepare_hub

        offline = prepare_hub()
    try:
        ds = datasets.load_dataset(path, streaming=True, **kwargs)
    except StopIteration:  # datasets' json reader on files without a single row
        raise ConfigError(f"data.dataset = {where!r}: the dataset is empty", "data.dataset") from None
    except Exception as e:  # offline, unknown name, bad subset, unreadable file: many types
        if local is not None and (found := local.unreadable()):
            raise found from None
        from torchllm.hub import offline_note

        reason = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"data.dataset: cannot open {where!r} (subset {subset!r}, split {split!r}): "
            f"{type(e).__name__}: {reason}"
            + ("" if local is not None else offline_note(offline)), "data.dataset"
        ) from None
    if local is not None:
        ds = local.rows(ds)
    # read one row: an empty dataset must fail here, not in a worker
    first = next(iter(ds), None)
    if first is None:
        raise ConfigError(f"data.dataset = {where!r}: the dataset is empty", "data.dataset")
    columns = list(first)
    if column not in columns:
        raise ConfigError(
            f"data.text_column = {column!r} is not a column of {where}; columns: {columns}",
            "data.text_column",
        )
    return ds, column


def stream_texts(rows_source, column: str, spec: str, text: bool = True) -> Iterator[str]:
    """Every row's `column` of a source that reads rows (`open_rows`), in order; `text`: each
    value must be a string (a conversation column, data.chat_column, holds message lists)."""
    ds, column = rows_source.open_rows(column)
    empty = True
    for index, row in enumerate(ds):
        empty = False
        value = row[column]
        if text and not isinstance(value, str):
            raise not_text(rows_source, spec, column, index, value)
        yield value
    if empty:
        raise ConfigError(f"data.dataset = {spec!r}: the dataset is empty", "data.dataset")


def not_text(rows_source, spec: str, column: str, index: int, value) -> ConfigError:
    """One line for a row whose `column` is not a string (null, a number, a list): its file and
    line when the source can find it (local files: `first_non_text`), else its row number."""
    find = getattr(rows_source, "first_non_text", None)
    place = (find(column) if find else None) or f"row {index}"
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    what = "null" if value is None else f"{type(value).__name__} {shown}"
    return ConfigError(f"data.dataset = {spec!r}: {place}: {column!r} is {what}, not text; "
                       f"fix or remove that row (every row's {column!r} must be a string)",
                       "data.dataset")
