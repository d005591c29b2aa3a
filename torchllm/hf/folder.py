"""A Hugging Face model folder's files: `config.json` and safetensors weights (one file, or
shards with the `model.safetensors.index.json` that `from_pretrained` follows)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from torchllm.hf.files import save_safetensors
from torchllm.hf.validate import check_hf_config, check_tensors

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
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



def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {hf_dir} is not a Hugging Face model "
                                "folder")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:  # (UnicodeDecodeError too)
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object (a Hugging Face config)")
    check_hf_config(config, path)  # no quantization_config, a positive integer vocab_size
    return config


def read_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of every shard listed in its index."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    if (hf_dir / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{hf_dir / INDEX} is not a safetensors index (a JSON object with "
                             f"a 'weight_map'): {type(e).__name__}: {e}") from None
    elif (hf_dir / WEIGHTS).is_file():
        shards = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{hf_dir} has neither {WEIGHTS} nor {INDEX} (only safetensors "
                                "weights are read)")
    weights = {}
    for shard in shards:
        path = hf_dir / shard
        try:
            tensors = load_file(str(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} does not exist (listed in {hf_dir / INDEX})") from None
        except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, empty, not one
            raise ValueError(f"{path} is not a readable safetensors file ({e}; "
                             f"{path.stat().st_size} bytes): re-download it") from None
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
