"""A Hugging Face folder's files, read through one `Store` of the folder (torchllm/store.py):
every file (`config.json`, `model.safetensors.index.json`, the shards it lists, the tokenizer
files) is a plain name inside the folder, no link is followed, and each read is bounded before
it is read. What the folder holds is data: a bad file is one line naming it (a ValueError, or
the store's `Confined`, an OSError; the CLI exits 2).

- JSON files (`config.json`, the index, `tokenizer_config.json`, `generation_config.json`) are
  at most `JSON_MAX` bytes, valid UTF-8 JSON objects, nested no deeper than Python's parser
  goes (a deeper one is refused by name, not a RecursionError traceback).
- Tokenizer files (`tokenizer.json`, `tokenizer.model`) are at most `TOKENIZER_MAX` bytes.
- A shard name the index lists must be a plain name inside the folder (`../x.safetensors` or
  `/abs/x.safetensors` is refused naming the index and the name); a shard's header is bounded
  by safetensors' own rules (100 MB), its tensors by the file's size.
- A link (a Hugging Face cache snapshot links its files into `blobs/`) is refused, with how to
  get plain files (`hf download REPO --local-dir DIR`).

A leaf over torchllm.store (the checkpoint's tokenizer identity reads an HF folder with it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torchllm.store import NOT_REGULAR, Confined, Store, plain_parts

INDEX = "model.safetensors.index.json"
JSON_MAX = 64 << 20  # config.json, the index: a few MB at most in real releases
TOKENIZER_MAX = 256 << 20  # tokenizer.json: ~30 MB for the largest vocabularies
LINK_HINT = ("; a Hugging Face cache snapshot links its files: `hf download REPO --local-dir DIR` "
             "writes plain files")


def hf_store(folder) -> Store:
    """The store of an HF folder (a path, or a Store already opened)."""
    return folder if isinstance(folder, Store) else Store(folder)


def has_file(store: Store, name: str) -> bool:
    """Whether the folder holds the regular file `name`; Confined (naming it) for a link, FIFO,
    folder or the like under that name."""
    kind = store.kind(name)
    if kind in (None, "file"):
        return kind == "file"
    what = NOT_REGULAR.get(kind, "a folder, not a file")
    raise Confined(f"{store.where(name)} is {what}" + (LINK_HINT if kind == "link" else ""))


def read_bytes(store: Store, name: str, max_bytes: int) -> bytes:
    """The file `name` of the folder (a regular file, no link, at most max_bytes)."""
    if not has_file(store, name):
        raise FileNotFoundError(f"{store.where(name)} does not exist")
    return store.read_bytes(name, max_bytes=max_bytes)


def read_json(store: Store, name: str) -> dict:
    """The JSON object in the folder's file `name` (at most JSON_MAX bytes); one line naming the
    file when it is not one."""
    return parse_json(read_bytes(store, name, JSON_MAX), store.where(name))


def parse_json(data: bytes, where) -> dict:
    """The JSON object in `data` (the file at `where`); one line naming the file otherwise."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"{where} nests its values deeper than a JSON file is read (Python's "
                         f"recursion limit, {sys.getrecursionlimit()}): not a Hugging Face "
                         "file; re-download it") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not a JSON object (it holds a {type(value).__name__})")
    return value


def shard_names(store: Store) -> list[str]:
    """The shard files `model.safetensors.index.json` lists, each a plain name inside the folder
    (refused naming the index and the name otherwise)."""
    where = store.where(INDEX)
    weight_map = read_json(store, INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{where} is not a safetensors index: it needs a 'weight_map' object "
                         "of tensor name: shard file")
    names = set()
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ValueError(f"{where}: weight_map[{tensor!r}] = {shard!r}: must be the name of "
                             "a shard file in the folder")
        try:
            plain_parts(shard)
        except Confined:
            raise Confined(f"{where} lists the shard {shard!r} (for {tensor}), which is not a "
                           f"file inside {store.root}: a shard must be named relative to its "
                           "folder, with no '..' and not absolute") from None
        names.add(shard)
    return sorted(names)


def load_shard(store: Store, name: str):
    """The tensors of the folder's safetensors file `name` (a regular file, no link): the
    descriptor the store opened is what safetensors reads (memory-mapped through
    /proc/self/fd, so a shard is never read into memory twice), else the bytes."""
    from safetensors.torch import load, load_file

    with store.open(name) as f:  # Confined for a link, a FIFO, a folder
        fd = None if store.remote else f.fileno()
        if fd is not None and Path(f"/proc/self/fd/{fd}").exists():
            return load_file(f"/proc/self/fd/{fd}")
        return load(f.read())


def tokenizer_bytes(store: Store, name: str) -> bytes:
    """A tokenizer file of the folder, bounded; its tokenizer_config.json checked as JSON."""
    if name == "tokenizer_config.json":
        data = read_bytes(store, name, JSON_MAX)
        parse_json(data, store.where(name))
        return data
    return read_bytes(store, name, TOKENIZER_MAX)
