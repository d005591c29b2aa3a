"""data.dataset = "shards:DIR": tokens written by `python -m torchllm.data.prepare`, memory-mapped
(or shards:s3://bucket/prefix, any fsspec URL: read by byte range); the index records the
tokenizer and the train / val splits. The shard files' format is here too: writing them (for
`prepare`) and opening them as token streams.

A shard directory holds
    index.json               tokenizer, dtype, vocab, and per split: shard files, token and
                             document counts
    {split}_{i:06d}.bin      a 256-byte header (magic, version, bytes per token, token count)
                             followed by the tokens (uint16 when the vocab fits, else uint32)
    {split}_docs.npy         int64 offset of every document's first token within the split
Shards are read through memory maps: a shard is never loaded whole. The folder may be an
object-store URL (s3://bucket/prefix, any fsspec URL): each window is then one ranged read of
its bytes, so a rank fetches only the windows it trains on.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import numpy as np

from torchllm.config.job_config import ConfigError
from torchllm.data.content import files_identity
from torchllm.data.sources.base import Source
from torchllm.data.sources.registry import register
from torchllm.data.token_stream import ShardPart, TokenStream
from torchllm.data.tokenizer import tokenizer_name, tokenizer_sha256
from torchllm.storage import Location, as_location, is_url, join, storage_for

MAGIC = b"TLLMSHRD"
VERSION = 1
HEADER_BYTES = 256
INDEX = "index.json"
SHARD_FILE = re.compile(r"(train|val)_([0-9]{6}\.bin|docs\.npy)", re.ASCII)  # what prepare writes


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _atomic_write(path: Path, data_writer) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        data_writer(f)
    tmp.replace(path)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    header[:8] = np.frombuffer(MAGIC, dtype=np.uint8)
    header[8:32] = np.array([VERSION, tokens.dtype.itemsize, len(tokens)], "<i8").view(np.uint8)
    _atomic_write(path, lambda f: (f.write(header.tobytes()), f.write(tokens.tobytes())))


def write_index(out: Path, index: dict) -> None:
    _atomic_write(out / INDEX, lambda f: f.write(json.dumps(index, indent=2).encode()))


def write_doc_starts(path: Path, starts: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, np.asarray(starts, dtype=np.int64)))


def storage_of(location: Location):
    """The storage holding `location` (a folder, or an object-store URL such as s3://b/p); a
    missing fsspec package (s3fs) is one line naming it."""
    try:
        return storage_for(location)
    except ImportError as e:
        raise ConfigError(f"data.dataset: {e}", "data.dataset") from None


def check_shard(path: Location, dtype: np.dtype, expected_tokens: int, size: int | None) -> None:
    """Raise a one-line error unless `path` (`size` bytes; None = missing) has a valid header
    matching the index."""
    if size is None:
        raise ConfigError(f"shard {path} listed in {INDEX} does not exist")
    header = storage_of(path).read_range(path, 0, min(size, HEADER_BYTES))
    if len(header) < HEADER_BYTES or header[:8] != MAGIC:
        raise ConfigError(f"shard {path} has a corrupt header: expected the {MAGIC!r} magic in a "
                          f"{HEADER_BYTES}-byte header (write shards with torchllm.data.prepare)")
    version, itemsize, count = np.frombuffer(header[8:32], "<i8")
    if (version, itemsize, count) != (VERSION, dtype.itemsize, expected_tokens) or (
        size != HEADER_BYTES + count * itemsize
    ):
        raise ConfigError(
            f"shard {path} has a corrupt header: version {version}, {itemsize} bytes/token, "
            f"{count} tokens, {size} bytes {'stored' if is_url(path) else 'on disk'}; expected "
            f"version {VERSION}, "
            f"{dtype.itemsize} bytes/token, {expected_tokens} tokens as {INDEX} says"
        )


def read_index(directory: Location) -> dict:
    storage = storage_of(directory)
    path = join(as_location(directory), INDEX)
    if not storage.is_file(path):
        raise ConfigError(f"data.dataset: {path} does not exist; write shards with "
                          "`python -m torchllm.data.prepare --out DIR ...`", "data.dataset")
    try:
        index = json.loads(storage.read_bytes(path))
        index["splits"], index["dtype"], index["vocab_size"]
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path} is not a torchllm shard index ({e})") from None
    return index


def open_split(directory: Location, split: str) -> TokenStream:
    """The split's shards as one token stream (headers checked; contents memory-mapped, or on
    an object store read in byte ranges as windows are asked for)."""
    directory = as_location(directory)
    index = read_index(directory)
    storage = storage_of(directory)
    info = index["splits"].get(split)
    listed = {s["file"] for s in (info or {}).get("shards", [])}
    stored = storage.files(directory)
    for name in sorted(n for n in stored if n.startswith(f"{split}_") and n.endswith(".bin")):
        if SHARD_FILE.fullmatch(name) and name not in listed:
            raise ConfigError(
                f"shard {join(directory, name)} is not listed in {join(directory, INDEX)}: a "
                "leftover of another prepare into this folder? Re-run prepare into a new folder "
                "(or with --overwrite) so the folder holds one corpus", "data.dataset")
    if info is None or info["tokens"] == 0:
        return TokenStream([np.zeros(0, np.int64)], np.zeros(0, np.int64))
    dtype = np.dtype(index["dtype"])
    parts = []
    for shard in info["shards"]:
        path = join(directory, shard["file"])
        check_shard(path, dtype, shard["tokens"], stored.get(shard["file"]))
        parts.append(ShardPart(str(path), dtype.str, HEADER_BYTES, shard["tokens"]))
    docs = join(directory, info["doc_starts"])
    if is_url(docs):  # one int64 per document: read whole
        doc_starts = np.load(io.BytesIO(storage.read_bytes(docs)))
    else:
        doc_starts = np.load(docs, mmap_mode="r")
    return TokenStream(parts, doc_starts)


@register
class Shards(Source):
    prefix = "shards"
    usage, order = "shards:DIR' or 'shards:s3://BUCKET/PREFIX", 2

    def carried_tokenizer(self) -> str:
        return read_index(self.location)["tokenizer"]

    def texts(self):
        raise ConfigError("data.dataset: shards: datasets are already tokenized; they have no "
                          "text to read (use their tokenizer, recorded in index.json)")

    def content_identity(self) -> str:
        """The full content of index.json and of every file it lists (both splits' shards and
        document offsets), streamed (from an object store too)."""
        folder = as_location(self.location)
        index = read_index(folder)
        names = [INDEX]
        for split in sorted(index["splits"]):
            info = index["splits"][split]
            names += [s["file"] for s in info.get("shards", [])]
            names += [info["doc_starts"]] if info.get("doc_starts") else []
        return files_identity([join(folder, n) for n in names])

    def check_vocab(self, tokenizer) -> None:
        """The run's tokenizer is the one the shards were made with: by its file's SHA-256
        (index.json's `tokenizer_sha256`, written by prepare), else by vocabulary size."""
        index = read_index(self.location)
        where = join(as_location(self.location), INDEX)
        if index["vocab_size"] != tokenizer.vocab_size:
            raise ConfigError(
                f"{where}: shards were tokenized with a "
                f"{index['vocab_size']}-token vocab ({index['tokenizer']}), but data.tokenizer "
                f"has {tokenizer.vocab_size}; use the shards' tokenizer (data.tokenizer = "
                "'auto' does)", "data.tokenizer"
            )
        saved, now = index.get("tokenizer_sha256"), tokenizer_sha256(tokenizer)
        if saved and saved != now:
            said = f"sha256 {now[:12]}" if now else "no tokenizer file to hash"
            raise ConfigError(
                f"{where}: shards were tokenized with {index['tokenizer']} (sha256 {saved[:12]}), "
                f"but this run's tokenizer is {tokenizer_name(tokenizer)} ({said}): the same "
                "ids would mean other tokens; use the shards' tokenizer (data.tokenizer = 'auto' "
                "loads it), or prepare the shards again with this one", "data.tokenizer")

    def token_split(self, tokenizer) -> tuple[TokenStream, TokenStream]:
        self.check_vocab(tokenizer)
        train, val = (open_split(self.location, s) for s in ("train", "val"))
        return train, val

    def whole_stream(self, tokenizer, max_tokens: int | None) -> TokenStream:
        """The val split, then the train split (all of it: max_tokens None)."""
        self.check_vocab(tokenizer)
        val, train = (open_split(self.location, s) for s in ("val", "train"))
        parts = [p for s in (val, train) if len(s) for p in s.parts]
        if not parts:
            raise ConfigError(f"{self.spec!r} holds no tokens", "data.dataset")
        starts = np.concatenate([val.doc_starts, train.doc_starts + len(val)])
        stream = TokenStream(parts, starts)
        cap = len(stream) if max_tokens is None else min(len(stream), max_tokens)
        out = TokenStream(stream.parts, stream.doc_starts, 0, cap)
        out.truncated = len(stream) > cap  # the run header says so
        return out
