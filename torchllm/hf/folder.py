"""A Hugging Face model folder's files: `config.json` and safetensors weights (one file, or
shards with the `model.safetensors.index.json` that `from_pretrained` follows)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from torchllm.hf.files import save_safetensors
from torchllm.hf_folder import INDEX, has_file, hf_store, load_shard, read_json, shard_names
from torchllm.hf.validate import check_hf_config, check_tensors

WEIGHTS = "model.safetensors"
# What an export writes: --overwrite replaces a folder holding only these.
EXPORT_FILE = re.compile(r"(generation_)?config\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
                         r"model\.safetensors\.index\.json|tokenizer\.model|tokenizer(_config)?\.json")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
    """'5GB', '200MB', '1000' -> bytes (decimal units, as the Hub uses)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: use a number of bytes or e.g. 5GB, 200MB")
    unit = match.group(2).upper() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])



def read_hf_config(hf_dir) -> dict:
    """config.json of the folder (a path or its Store; read through the store: no link, at
    most reading.JSON_MAX bytes), checked to describe plain float weights."""
    store = hf_store(hf_dir)
    path = store.where("config.json")
    if not has_file(store, "config.json"):
        raise FileNotFoundError(f"{path} does not exist: {store.root} is not a Hugging Face "
                                "model folder")
    config = read_json(store, "config.json")
    check_hf_config(config, path)  # no quantization_config, a positive integer vocab_size
    return config


def read_hf_weights(hf_dir) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of every shard listed in its index (each a plain
    name inside the folder, read through its Store: reading.py)."""
    store = hf_store(hf_dir)
    if has_file(store, INDEX):
        shards = shard_names(store)  # each a plain name inside the folder
    elif has_file(store, WEIGHTS):
        shards = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{store.root} has neither {WEIGHTS} nor {INDEX} (only "
                                "safetensors weights are read)")
    weights = {}
    for shard in shards:
        path = store.where(shard)
        try:
            tensors = load_shard(store, shard)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} does not exist (listed in "
                                    f"{store.where(INDEX)})") from None
        except OSError:  # Confined: a link, a FIFO, a folder
            raise
        except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, empty, not one
            raise ValueError(f"{path} is not a readable safetensors file ({e}; "
                             f"{store.size(shard)} bytes): re-download it") from None
        check_tensors(tensors, path)  # float dtypes, finite values
        weights.update(tensors)
    return weights


def write_hf_weights(weights: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """One file, or shards of at most max_shard_bytes (a bigger tensor gets a shard of its own)
    with the `model.safetensors.index.json` that `from_pretrained` follows."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    metadata = {"format": "pt"}  # transformers expects it
    if len(shards) == 1:
        save_safetensors(shards[0], out / WEIGHTS, metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, out / name, metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
