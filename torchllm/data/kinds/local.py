"""data.dataset = "local:PATH": .txt (one file = one document), .jsonl or .parquet files (a file,
a glob or a folder), read through `datasets`' streaming reader and tokenized in memory."""

from __future__ import annotations

from pathlib import Path

from torchllm.data.kinds.base import CorpusKind
from torchllm.data.kinds.registry import register
from torchllm.data.sources import LOCAL_BUILDERS, load_streaming, local_files, stream_texts


@register
class LocalFiles(CorpusKind):
    prefix = "local"
    usage, order = "local:PATH", 1
    label = "local"  # the kind the user wrote, in unreadable-file errors (chat: sets "chat")

    def preflight(self) -> None:
        local_files(self.location)  # a missing file: one line naming it, before any rank starts

    def open_rows(self, column: str):
        """(streaming dataset of the files' rows, the column holding `column`'s values)."""
        files = local_files(self.location)
        builder = LOCAL_BUILDERS[Path(files[0]).suffix]
        kwargs = {"data_files": files, "split": "train"}
        if builder == "text":  # one document per .txt file, in a column named "text"
            kwargs["sample_by"], column = "document", "text"
            kwargs["encoding"] = "utf-8-sig"  # a byte-order mark starting a file is not text
        return load_streaming(builder, kwargs, f"local:{self.location}", column,
                              local=(self.label, self.location))

    def texts(self):
        return stream_texts(self, self.dcfg.text_column, self.spec)
