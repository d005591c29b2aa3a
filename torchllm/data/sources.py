"""Where documents come from: the named-dataset registry, local files and Hugging Face streams.

`data.dataset` is one of
    embedded            CPython's bundled docs (no download; the default)
    <registry name>     an entry of HF_DATASETS below, streamed from the Hugging Face Hub
    hf:<name or path>   any Hugging Face dataset, streamed (data.hf_subset / hf_split)
    local:<path>        .txt / .jsonl / .parquet files: a file, a glob or a folder
    shards:<dir>        pre-tokenized shards written by `python -m torchllm.data.prepare`
A new Hub dataset is one line in HF_DATASETS.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from torchllm.config.job_config import ConfigError
from torchllm.data.embedded import embedded_documents


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


@dataclass(frozen=True)
class Source:
    """A resolved data.dataset: kind is embedded | local | shards | hf."""

    kind: str
    location: str = ""
    subset: str | None = None
    split: str = "train"


def resolve(dcfg) -> Source:
    spec = dcfg.dataset
    if spec == "embedded":
        return Source("embedded")
    if spec in HF_DATASETS:
        entry = HF_DATASETS[spec]
        return Source("hf", entry.path, dcfg.hf_subset or entry.subset, dcfg.hf_split or entry.split)
    kind, sep, location = spec.partition(":")
    if sep and kind in ("local", "shards", "hf") and location:
        return Source(kind, location, dcfg.hf_subset or None, dcfg.hf_split or "train")
    raise ConfigError(
        f"data.dataset = {spec!r} is not known; use 'embedded', one of {sorted(HF_DATASETS)}, "
        "'hf:NAME', 'local:PATH' or 'shards:DIR'",
        "data.dataset",
    )


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


def open_stream(source: Source, text_column: str, label: str = "local"):
    """A streaming `datasets.IterableDataset` for a local or hf source, column checked.

    Local files go through the same streaming reader as the Hub, so no Arrow cache is written and
    HF_DATASETS_OFFLINE=1 works.
    """
    datasets = import_datasets(f"data.dataset = {source.kind}:{source.location!r}")
    if source.kind == "local":
        files = local_files(source.location)
        builder = LOCAL_BUILDERS[Path(files[0]).suffix]
        if builder == "text":  # one document per .txt file, in a column named "text"
            kwargs, text_column = {"sample_by": "document"}, "text"
        else:
            kwargs = {}
        where, path = f"local:{source.location}", builder
        kwargs.update(data_files=files, split="train")
    else:
        where, path = source.location, source.location
        kwargs = {"name": source.subset, "split": source.split}
    try:
        ds = datasets.load_dataset(path, streaming=True, **kwargs)
    except StopIteration:  # datasets' json reader on files without a single row
        raise ConfigError(f"data.dataset = {where!r}: the dataset is empty", "data.dataset") from None
    except Exception as e:  # offline, unknown name, bad subset, unreadable file: many types
        if source.kind == "local" and (found := unreadable(f"{label}:{source.location}",
                                                           source.location)):
            raise found from None
        raise ConfigError(
            f"data.dataset: cannot open {where!r} (subset {source.subset!r}, split "
            f"{source.split!r}): {type(e).__name__}: {e}", "data.dataset"
        ) from None
    # read one row: an empty dataset must fail here, not in a worker
    first = next(iter(read_rows(ds, source, label)), None)
    if first is None:
        raise ConfigError(f"data.dataset = {where!r}: the dataset is empty", "data.dataset")
    columns = list(first)
    if text_column not in columns:
        raise ConfigError(
            f"data.text_column = {text_column!r} is not a column of {where}; columns: {columns}",
            "data.text_column",
        )
    return ds, text_column


def read_rows(ds, source: Source, label: str = "local") -> Iterator[dict]:
    """The rows of `open_stream`'s dataset; a local file that cannot be read (not UTF-8, a bad
    JSON line, ...) is a one-line ConfigError naming the file and line instead of a traceback
    (`label`: the dataset kind the user wrote, local or chat)."""
    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except ConfigError:
            raise
        except Exception as e:  # UnicodeDecodeError, ArrowInvalid, ...: which file is unsaid
            if source.kind != "local":
                raise
            where = f"{label}:{source.location}"
            raise (unreadable(where, source.location) or ConfigError(
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


def documents(dcfg) -> Iterator[str]:
    """Every document's text, in the dataset's order (embedded, local or hf sources)."""
    source = resolve(dcfg)
    if source.kind == "embedded":
        yield from embedded_documents()
        return
    if source.kind == "shards":
        raise ConfigError("data.dataset: shards: datasets are already tokenized; they have no "
                          "text to read (use their tokenizer, recorded in index.json)")
    ds, column = open_stream(source, dcfg.text_column)
    empty = True
    for row in read_rows(ds, source):
        empty = False
        yield row[column]
    if empty:
        raise ConfigError(f"data.dataset = {dcfg.dataset!r}: the dataset is empty", "data.dataset")
