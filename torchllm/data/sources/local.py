"""data.dataset = "local:PATH": .txt (one file = one document), .jsonl or .parquet files (a file,
a glob or a folder), read through `datasets`' streaming reader (sources/rows.py) and tokenized in
memory; as chat:PATH, their conversations (torchllm/data/packing/chat.py)."""

from __future__ import annotations

import glob
import json
import os
import stat
from pathlib import Path
from typing import Iterator

from torchllm.config.job_config import ConfigError
from torchllm.data.content import files_identity
from torchllm.data.sources.base import CorpusSource
from torchllm.data.sources.registry import register
from torchllm.data.sources.rows import load_streaming, stream_texts
from torchllm.storage import shown


LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def local_files(location: str) -> list[str]:
    """The data files a local: spec names (a file, a glob or a folder), sorted: regular files
    only, checked by stat before anything opens one (a FIFO would block the reader), and in a
    folder nothing a link leads to outside it (a link is named, never followed out)."""
    path = Path(location)
    if path.is_dir():
        files = folder_files(location, path)
    else:
        files = sorted(glob.glob(location)) if glob.has_magic(location) else [location]
    present = []
    for f in files:
        try:
            mode = os.stat(f).st_mode
        except OSError:
            continue  # missing (or a dangling link): the line below
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"data.dataset = 'local:{location}': {f} is {_kind(mode)}, not a regular file; "
                "a local: source reads regular files only: remove it or move it out of the way",
                "data.dataset")
        present.append(f)
    if not files or len(present) != len(files):
        raise ConfigError(f"data.dataset = 'local:{location}': no such file or no "
                          f"{'/'.join(LOCAL_BUILDERS)} files there: {shown(location)}",
                          "data.dataset")
    suffixes = {Path(f).suffix for f in files}
    if not suffixes <= set(LOCAL_BUILDERS):
        raise ConfigError(
            f"data.dataset = 'local:{location}': files must have one of the suffixes "
            f"{', '.join(LOCAL_BUILDERS)}; found {', '.join(sorted(suffixes))}", "data.dataset"
        )
    if len(suffixes) != 1:  # one reader per source: .txt is one document a file, .jsonl rows
        kinds = ", ".join(f"{sum(Path(f).suffix == x for f in files)} {x}"
                          for x in sorted(suffixes))
        first = sorted(suffixes)[0]
        raise ConfigError(
            f"data.dataset = 'local:{location}' mixes kinds of files ({kinds}); one local: "
            f"source reads one kind: name one with a glob (e.g. 'local:{location.rstrip('/')}"
            f"/*{first}'), or list each kind in [[data.sources]] (docs/data.md)", "data.dataset")
    return files


def folder_files(location: str, folder: Path) -> list[str]:
    """The data files under `folder` (sorted); a link anywhere in it that leads outside it is a
    ConfigError naming the link (links to folders are listed, never walked)."""
    root, files = folder.resolve(), []
    for top, dirs, names in os.walk(folder):  # followlinks=False
        for name in (*names, *dirs):
            entry = Path(top) / name
            if entry.is_symlink() and not Path(os.path.realpath(entry)).is_relative_to(root):
                raise ConfigError(
                    f"data.dataset = 'local:{location}': {entry} is a link to "
                    f"{os.path.realpath(entry)}, outside the folder; a local: folder reads only "
                    "what is inside it: copy the file in (or name it in data.dataset / "
                    "[[data.sources]]) and remove the link", "data.dataset")
        files += [str(Path(top) / n) for n in names if Path(n).suffix in LOCAL_BUILDERS]
    return sorted(files)


def _kind(mode: int) -> str:
    """What a stat mode that is not a regular file's is, in words."""
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a folder" if stat.S_ISDIR(mode) else "not a file")


class LocalReading:
    """How local files' rows are read (load_streaming's `local`): a file that cannot be read
    (not UTF-8, a bad JSON line, ...) is a one-line ConfigError naming the file and line instead
    of a traceback. `where`: the data.dataset value the user wrote (local:PATH or chat:PATH)."""

    def __init__(self, where: str, location: str):
        self.where, self.location = where, location

    def unreadable(self) -> ConfigError | None:
        return unreadable(self.where, self.location)

    def rows(self, ds) -> "LocalRows":
        return LocalRows(ds, self.where, self.location)


class LocalRows:
    """The rows of local files' streaming dataset, each read error named (LocalReading)."""

    def __init__(self, ds, where: str, location: str):
        self.ds, self.where, self.location = ds, where, location

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
                where = self.where
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


@register
class LocalFiles(CorpusSource):
    prefix = "local"
    usage, order = "local:PATH", 1

    def preflight(self) -> None:
        local_files(self.location)  # a missing file: one line naming it, before any rank starts

    def content_identity(self) -> str:
        """The full content of every file it reads (chat:PATH reads through this source too)."""
        return files_identity(local_files(self.location))

    def open_rows(self, column: str, spec: str | None = None):
        """(streaming dataset of the files' rows, the column holding `column`'s values); `spec`:
        the data.dataset value the user wrote (chat:PATH), named when a file cannot be read."""
        files = local_files(self.location)
        builder = LOCAL_BUILDERS[Path(files[0]).suffix]
        kwargs = {"data_files": files, "split": "train"}
        if builder == "text":  # one document per .txt file, in a column named "text"
            kwargs["sample_by"], column = "document", "text"
            kwargs["encoding"] = "utf-8-sig"  # a byte-order mark starting a file is not text
        return load_streaming(builder, kwargs, spec or self.spec, column,
                              local=LocalReading(spec or self.spec, self.location))

    def texts(self):
        return stream_texts(self, self.dcfg.text_column, self.spec)

    def first_non_text(self, column: str) -> str | None:
        """'FILE line N' (.jsonl) or 'FILE row N' (.parquet, from 0) of the first row whose
        `column` is not a string, found by reading the files again; None if none is found."""
        for f in local_files(self.location):
            if f.endswith(".jsonl"):
                with open(f, encoding="utf-8") as fh:
                    for lineno, line in enumerate(fh, 1):
                        try:
                            row = json.loads(line) if line.strip() else {}
                        except ValueError:
                            continue  # (named by `unreadable` when the reader meets it)
                        if isinstance(row, dict) and column in row \
                                and not isinstance(row[column], str):
                            return f"{f} line {lineno}"
            elif f.endswith(".parquet"):
                import pyarrow.parquet as pq

                values = pq.read_table(f, columns=[column]).column(column).to_pylist()
                bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
                if bad is not None:
                    return f"{f} row {bad}"
        return None

    def values(self, column: str, spec: str) -> list:
        ds, column = self.open_rows(column, spec)
        return [row[column] for row in ds]  # a file that cannot be read is named (LocalRows)
