"""Reading text and rows: the named Hub datasets, local data files and `datasets` streams.

Which `data.dataset` values exist is the kinds' business (torchllm/data/kinds/: one module per
kind, one registry); this module holds what several kinds read with:
    HF_DATASETS         named Hugging Face datasets (a new one is one line here)
    local_files         the files a local: spec names
    load_streaming      a streaming `datasets.IterableDataset`, opened and checked
    documents           every document's text of a data config (any kind with text)
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from torchllm.config.job_config import ConfigError


@dataclass(frozen=True)
class HFDataset:
    path: str
    subset: str | None = None
    split: str = "train"


HF_DATASETS = {
    "fineweb_edu": HFDataset("HuggingFaceFW/fineweb-edu", "sample-10BT"),
    "fineweb_edu_100b": HFDataset("karpathy/fineweb-edu-100b-shuffle"),
}

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def local_files(location: str) -> list[str]:
    """The data files a local: spec names (a file, a glob or a folder), sorted."""
    path = Path(location)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS)
    else:
        files = sorted(glob.glob(location)) if glob.has_magic(location) else [location]
    if not files or not all(Path(f).is_file() for f in files):
        raise ConfigError(f"data.dataset = 'local:{location}': no such file or no "
                          f"{'/'.join(LOCAL_BUILDERS)} files there", "data.dataset")
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) != 1 or not suffixes <= set(LOCAL_BUILDERS):
        raise ConfigError(
            f"data.dataset = 'local:{location}': files must all have one of the suffixes "
            f"{', '.join(LOCAL_BUILDERS)}; found {', '.join(sorted(suffixes))}", "data.dataset"
        )
    return files


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
                   split: str = "train", local: tuple[str, str] | None = None):
    """(`datasets.load_dataset(path, streaming=True, **kwargs)`, column), checked: it opens, it
    has a row, and the row has `column`. `where` names the source in errors. `local`: (label,
    location) of local files (label: the kind the user wrote, local or chat): their rows are
    read through `LocalRows`, which names a file that cannot be read.

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
        if local is not None and (found := unreadable(f"{local[0]}:{local[1]}", local[1])):
            raise found from None
        from torchllm.hub import offline_note

        reason = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"data.dataset: cannot open {where!r} (subset {subset!r}, split {split!r}): "
            f"{type(e).__name__}: {reason}"
            + ("" if local is not None else offline_note(offline)), "data.dataset"
        ) from None
    if local is not None:
        ds = LocalRows(ds, *local)
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


class LocalRows:
    """The rows of local files' streaming dataset; a file that cannot be read (not UTF-8, a bad
    JSON line, ...) is a one-line ConfigError naming the file and line instead of a traceback
    (`label`: the dataset kind the user wrote, local or chat)."""

    def __init__(self, ds, label: str, location: str):
        self.ds, self.label, self.location = ds, label, location

    def __iter__(self) -> Iterator[dict]:
        rows = iter(self.ds)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except ConfigError:
                raise
            except Exception as e:  # UnicodeDecodeError, ArrowInvalid, ...: which file is unsaid
                where = f"{self.label}:{self.location}"
                raise (unreadable(where, self.location) or ConfigError(
                    f"{where}: cannot read it: {type(e).__name__}: {e}", "data.dataset")) from None
            yield row


def unreadable(where: str, location: str) -> ConfigError | None:
    """Why the files of LOCATION failed to read: the first line that is not UTF-8 (or, in
    .jsonl, not JSON), found by scanning them again; None if every line reads."""
    for f in local_files(location):
        if Path(f).suffix not in (".txt", ".jsonl", ".json"):
            continue  # parquet: binary, the reader's message below
        with open(f, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return ConfigError(
                        f"{where}: {f} is not UTF-8 text (line {lineno}, byte {e.start}: "
                        f"{raw[e.start:e.start + 1]!r}); convert it (e.g. iconv -f latin1 -t "
                        "utf-8) or remove it", "data.dataset")
                if f.endswith(".jsonl") and line.strip():
                    try:
                        json.loads(line)
                    except ValueError as e:
                        return ConfigError(f"{where}: {f} line {lineno} is not valid JSON "
                                           f"({e})", "data.dataset")
    return None


def stream_texts(rows_source, column: str, spec: str) -> Iterator[str]:
    """Every row's `column` of a kind that reads rows (`open_rows`), in order."""
    ds, column = rows_source.open_rows(column)
    empty = True
    for row in ds:
        empty = False
        yield row[column]
    if empty:
        raise ConfigError(f"data.dataset = {spec!r}: the dataset is empty", "data.dataset")


def documents(dcfg) -> Iterator[str]:
    """Every document's text of data.dataset, in the dataset's order (kinds that hold text)."""
    from torchllm.data.kinds import parse_source

    return parse_source(dcfg).texts()
