"""Pre-tokenized shard files: writing them (for `prepare`) and opening them as token streams.

A shard directory holds
    index.json               tokenizer, dtype, vocab, and per split: shard files, token and
                             document counts
    {split}_{i:06d}.bin      a 256-byte header (magic, version, bytes per token, token count)
                             followed by the tokens (uint16 when the vocab fits, else uint32)
    {split}_docs.npy         int64 offset of every document's first token within the split
Shards are read through memory maps: a shard is never loaded whole.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from torchllm.config.job_config import ConfigError
from torchllm.data.token_stream import ShardPart, TokenStream

MAGIC = b"TLLMSHRD"
VERSION = 1
HEADER_BYTES = 256
INDEX = "index.json"
SHARD_FILE = re.compile(r"(train|val)_(\d{6}\.bin|docs\.npy)")  # the files prepare writes


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


def check_shard(path: Path, dtype: np.dtype, expected_tokens: int) -> None:
    """Raise a one-line error unless `path` has a valid header matching the index."""
    if not path.is_file():
        raise ConfigError(f"shard {path} listed in {INDEX} does not exist")
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[:8] != MAGIC:
        raise ConfigError(f"shard {path} has a corrupt header: expected the {MAGIC!r} magic in a "
                          f"{HEADER_BYTES}-byte header (write shards with torchllm.data.prepare)")
    version, itemsize, count = np.frombuffer(header[8:32], "<i8")
    size = path.stat().st_size
    if (version, itemsize, count) != (VERSION, dtype.itemsize, expected_tokens) or (
        size != HEADER_BYTES + count * itemsize
    ):
        raise ConfigError(
            f"shard {path} has a corrupt header: version {version}, {itemsize} bytes/token, "
            f"{count} tokens, {size} bytes on disk; expected version {VERSION}, "
            f"{dtype.itemsize} bytes/token, {expected_tokens} tokens as {INDEX} says"
        )


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX
    if not path.is_file():
        raise ConfigError(f"data.dataset: {path} does not exist; write shards with "
                          "`python -m torchllm.data.prepare --out DIR ...`", "data.dataset")
    try:
        index = json.loads(path.read_text())
        index["splits"], index["dtype"], index["vocab_size"]
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path} is not a torchllm shard index ({e})") from None
    return index


def open_split(directory: str | Path, split: str) -> TokenStream:
    """The split's shards as one token stream (headers checked, contents memory-mapped)."""
    directory = Path(directory)
    index = read_index(directory)
    info = index["splits"].get(split)
    listed = {s["file"] for s in (info or {}).get("shards", [])}
    for path in sorted(directory.glob(f"{split}_*.bin")):
        if SHARD_FILE.fullmatch(path.name) and path.name not in listed:
            raise ConfigError(
                f"shard {path} is not listed in {directory / INDEX}: a leftover of another "
                "prepare into this folder? Re-run prepare into a new folder (or with "
                "--overwrite) so the folder holds one corpus", "data.dataset")
    if info is None or info["tokens"] == 0:
        return TokenStream([np.zeros(0, np.int64)], np.zeros(0, np.int64))
    dtype = np.dtype(index["dtype"])
    parts = []
    for shard in info["shards"]:
        path = directory / shard["file"]
        check_shard(path, dtype, shard["tokens"])
        parts.append(ShardPart(str(path), dtype.str, HEADER_BYTES, shard["tokens"]))
    doc_starts = np.load(directory / info["doc_starts"], mmap_mode="r")
    return TokenStream(parts, doc_starts)
