"""Hugging Face interop: export a checkpoint as a `transformers` model folder, import one back.

    python -m torchllm.checkpoint.hf export --checkpoint RUN_OR_CKPT --out HF_DIR
        [--dtype bfloat16] [--max-shard-size 5GB] [--vocab-size N] [--overwrite] [--adapter]
        [--section.key=value ...]
    python -m torchllm.checkpoint.hf import --hf HF_DIR --out CKPT/step-0
        --job.config_file RUN.toml [--dtype float32] [--overwrite] [--section.key=value ...]

`export` reads the config the step was written under (the step folder's `config.toml`, else
the run's) to rebuild the model's args and writes `config.json`, `model.safetensors` (sharded
with an index over the size limit) and the run's tokenizer (SentencePiece, tiktoken as a
tokenizer.json, or tokenizer.json; with the chat template a chat run trained with, see
hf_tokenizer.py): a folder `from_pretrained` loads. `import` writes a complete weights-only DCP checkpoint for the model
the given config describes (usable as `checkpoint.initial_load_path`). A run can also start
straight from a HF folder with `checkpoint.initial_load_in_hf = true` (see `load_hf_weights`).
Extra `--section.key=value` arguments are config overrides, as for training.
Both write beside the output and rename it when complete; an existing output is refused
unless --overwrite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from torchllm import models
from torchllm.checkpoint.convert import load_dcp_weights, refuse_step_folder, replace_dir, \
    save_safetensors, save_seed_checkpoint, temp_sibling
from torchllm.checkpoint.integrity import open_for_reading
from torchllm.checkpoint.layout import (
    EXPORT_DTYPES,
    checkpoint_config,
    mark_complete,
    run_folder_of,
    step_of,
)
from torchllm.checkpoint.storage import is_url, join, storage_for
from torchllm.config import ConfigError, load_config
from torchllm.log import logger
from torchllm.models import adapter_for_hf, adapter_for_model
from torchllm.models.lora import plain_weights

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


# ------------------------------------------------------------------------ HF folder I/O


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {hf_dir} is not a Hugging Face model "
                                "folder")
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # (UnicodeDecodeError too)
        raise ValueError(f"{path} is not valid JSON ({e})") from None


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
            weights.update(load_file(str(path)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} does not exist (listed in {hf_dir / INDEX})") from None
        except Exception as e:  # noqa: BLE001 - SafetensorError: truncated, empty, not one
            raise ValueError(f"{path} is not a readable safetensors file ({e}; "
                             f"{path.stat().st_size} bytes): re-download it") from None
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


def write_tokenizer_files(tokenizer, out: Path, hf_config: dict, chat: bool = False) -> str | None:
    """The run's tokenizer files (and chat template) for `AutoTokenizer`: hf_tokenizer.py."""
    from torchllm.checkpoint.hf_tokenizer import write_tokenizer

    return write_tokenizer(tokenizer, out, hf_config, chat)


# ------------------------------------------------------------------------------- export


def _run_config(step_path: Path, overrides: list[str]):
    """The config the step was written under: the step folder's config.toml, else the run's
    (run/<folder>/step-N -> run/config.toml)."""
    if any(a.startswith("--job.config_file") for a in overrides):
        return load_config(overrides)
    path = checkpoint_config(step_path)
    if path is None:
        raise ConfigError(f"neither {join(step_path, 'config.toml')} nor the run's config.toml "
                          "exists; pass the run's config with --job.config_file")
    return load_config(["--job.config_file", str(path), *overrides])


def _trained_on_chat(cfg) -> bool:
    """Whether the run trained on conversations (its export then carries a chat template)."""
    from torchllm.config.job_config import reads_conversations

    return bool(cfg.data.chat_tokens) or reads_conversations(cfg.data)


def _tokenizer_of(cfg, step_path, run_dir: Path):
    """The run's tokenizer (an 'auto' one cached in the run's data folder), checked against the
    one the step records; never trained here (a missing one is a one-line ConfigError)."""
    from torchllm.run.tokenizer import inference_tokenizer

    return inference_tokenizer(cfg, step_path, run_dir / "data")


def export_hf(checkpoint: str | Path, out: str | Path, overrides: list[str] = (),
              dtype: str | None = None, max_shard_bytes: int = 5 * 10**9,
              vocab_size: int | None = None, overwrite: bool = False,
              lora: str = "merge") -> Path:
    """Write a Hugging Face model folder from a DCP checkpoint; returns the folder. A LoRA
    run's model is merged (W + alpha/rank * B @ A), or with lora="base" its base alone. An
    fsspec
    URL `out` (s3://bucket/prefix) gets a local export uploaded file by file, config.json last.

    It is written beside `out` and renamed when complete; a non-empty `out` is refused (stale
    shards of an earlier export would mix with this one) unless overwrite, which replaces it.
    """
    if is_url(out):
        return _export_to_store(checkpoint, out, overrides, dtype, max_shard_bytes, vocab_size,
                                overwrite)
    out = Path(out)
    used = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if used and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it, or export "
                              "into a new folder")
    foreign = [name for name in used if not EXPORT_FILE.fullmatch(name)]
    if foreign:  # e.g. --out . by mistake: never move a folder of other files aside
        raise FileExistsError(f"{out} holds files an export does not write "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                              "--overwrite replaces only an earlier export: choose a new folder")
    step_path = open_for_reading(checkpoint)  # checksums, data-only metadata
    cfg = _run_config(step_path, list(overrides))
    adapter = adapter_for_model(cfg.model.name)
    tokenizer = _tokenizer_of(cfg, step_path, run_folder_of(step_path, cfg))
    vocab = vocab_size or cfg.model.vocab_size or (tokenizer.vocab_size if tokenizer else None)
    if vocab is None:
        raise ConfigError("the unpadded vocab size is unknown (no model.vocab_size, tokenizer not "
                          "found); pass --vocab-size")
    args = models.model_args(cfg, vocab)
    weights = plain_weights(load_dcp_weights(step_path, opened=True), cfg,
                            merge=lora == "merge")
    saved_vocab = weights["tok_embeddings.weight"].shape[0]
    if saved_vocab != args.vocab_size:
        raise ConfigError(f"checkpoint {step_path} has a vocab of {saved_vocab} rows but its "
                          f"config gives {args.vocab_size} (padded from {vocab}); check --vocab-size")
    hf_weights = adapter.to_hf(weights, args, vocab)
    if dtype is not None:
        hf_weights = {k: v.to(EXPORT_DTYPES[dtype]) for k, v in hf_weights.items()}
    final, out = out, temp_sibling(out, "export-tmp")
    try:
        out.mkdir()
        _write_export(out, adapter, args, vocab, hf_weights, tokenizer, max_shard_bytes,
                      chat=_trained_on_chat(cfg), sampling=cfg.eval)
        replace_dir(out, final)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    logger.info("exported %s (%s, vocab %d of %d padded) to %s", step_path, cfg.model.name, vocab,
                args.vocab_size, final)
    return final


def _export_to_store(checkpoint, out: str, overrides, dtype, max_shard_bytes, vocab_size,
                     overwrite: bool) -> str:
    import tempfile

    store = storage_for(out)
    if store.is_dir(out) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it, or export "
                              "into a new prefix")
    with tempfile.TemporaryDirectory(prefix="torchllm-export-") as tmp:
        local = export_hf(checkpoint, Path(tmp) / "export", overrides, dtype, max_shard_bytes,
                          vocab_size)
        store.remove_tree(out)  # an earlier export's shards must not mix with this one's
        names = sorted(p.name for p in local.iterdir())
        for name in sorted(names, key=lambda n: n == "config.json"):  # config.json last
            store.upload(local / name, join(out, name))
    logger.info("uploaded the export to %s", out)
    return out


def generation_config(config: dict, sampling) -> dict:
    """generation_config.json: the end-of-sequence ids (with a chat template, its end-of-turn
    too) and the run's sampling defaults (`[eval]`: what `torchllm.generate` uses)."""
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    gen["max_new_tokens"] = sampling.max_new_tokens
    if sampling.temperature > 0:
        gen.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                   top_p=sampling.top_p)
    else:  # greedy
        gen["do_sample"] = False
    return gen


def _write_export(out: Path, adapter, args, vocab: int, hf_weights: dict, tokenizer,
                  max_shard_bytes: int, chat: bool = False, sampling=None) -> None:
    config = adapter.config(args, vocab)
    config["torch_dtype"] = str(next(iter(hf_weights.values())).dtype).removeprefix("torch.")
    if tokenizer is not None and tokenizer.vocab_size != vocab:
        logger.warning("the run's tokenizer has %d ids, the model's vocab is %d: no tokenizer "
                       "files written", tokenizer.vocab_size, vocab)
    elif tokenizer is not None:
        if what := write_tokenizer_files(tokenizer, out, config, chat):
            logger.info("wrote the tokenizer: %s", what)
        else:
            logger.warning("tokenizer %s cannot be exported: no tokenizer files written",
                           type(tokenizer).__name__)
    write_hf_weights(hf_weights, out, max_shard_bytes)
    if sampling is not None:
        (out / "generation_config.json").write_text(
            json.dumps(generation_config(config, sampling), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ------------------------------------------------------------------------------- import


def convert_from_hf(hf_dir: str | Path, adapter, args) -> dict[str, torch.Tensor]:
    """A HF folder's weights as the state dict of the torchllm model `args` describes."""
    hf_config = read_hf_config(hf_dir)
    if adapter_for_hf(hf_config) is not adapter:
        raise ConfigError(f"{hf_dir} holds a {hf_config['model_type']!r} model, not a "
                          f"{adapter.model_type!r} one; set model.name to match")
    adapter.check(hf_config, args)
    try:
        return adapter.from_hf(read_hf_weights(hf_dir), args)
    except KeyError as e:
        raise ValueError(f"{hf_dir}: the weights lack {e.args[0]!r}, which its config "
                         "implies") from None


def import_hf(hf_dir: str | Path, out_dir: str | Path, overrides: list[str] = (),
              dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write a complete weights-only DCP checkpoint (a seed checkpoint) from a HF folder."""
    out = Path(out_dir)
    step = step_of(out)
    if step is None:
        raise ValueError(f"{out}: the output folder must be named step-<N> (e.g. .../step-0)")
    refuse_step_folder(out, overwrite)
    cfg = load_config(list(overrides))
    hf_vocab = read_hf_config(hf_dir).get("vocab_size")
    args = models.model_args(cfg, hf_vocab)
    weights = convert_from_hf(hf_dir, adapter_for_model(cfg.model.name), args)
    weights = {k: v.to(EXPORT_DTYPES[dtype]).contiguous() for k, v in weights.items()}
    save_seed_checkpoint(weights, out, step,
                         lambda tmp: _seed_config_and_tokenizer(hf_dir, out, tmp, cfg, hf_vocab))
    logger.info("imported %s as %s/%s (vocab %d padded to %d) into %s", hf_dir, cfg.model.name,
                cfg.model.flavor, hf_vocab, args.vocab_size, out)
    return out


def _seed_config_and_tokenizer(hf_dir, out: Path, tmp: Path, cfg, hf_vocab: int) -> dict:
    """Into the seed checkpoint `out` (being written in `tmp`): the HF folder's tokenizer files
    (else the config's named tokenizer) and the config.toml naming it, as training writes them,
    so generate reads the seed like a run's step and a stage from it takes its tokenizer
    (data.tokenizer = 'auto' / 'from_initial_load'); returns the marker's tokenizer record."""
    from torchllm.checkpoint.tokenizer_identity import (
        FROM_INITIAL_LOAD, NEW, hf_folder_tokenizer, tokenizer_record,
    )
    from torchllm.config import to_toml
    from torchllm.data import build_tokenizer

    found = hf_folder_tokenizer(hf_dir)
    named = cfg.data.tokenizer not in ("auto", NEW, FROM_INITIAL_LOAD)
    info, data = {}, cfg.data
    if found is not None:
        file, chat = found
        for name in (file.name, "tokenizer_config.json"):
            if (Path(hf_dir) / name).is_file():
                shutil.copyfile(Path(hf_dir) / name, tmp / name)
        if named:
            logger.info("recorded %s's own tokenizer %s (not the config's data.tokenizer = %r)",
                        hf_dir, file.name, cfg.data.tokenizer)
        data = dataclasses.replace(data, tokenizer=str(tmp / file.name), chat_tokens=chat)
    elif not named:
        logger.warning("%s has no tokenizer.json or tokenizer.model and the config names none: "
                       "the seed records no tokenizer (name it in data.tokenizer to use the "
                       "seed)", hf_dir)
    if found is not None or named:
        tokenizer = build_tokenizer(dataclasses.replace(cfg, data=data), tmp, train=False)
        if tokenizer.vocab_size > hf_vocab:
            raise ConfigError(f"the tokenizer {data.tokenizer} has {tokenizer.vocab_size} ids, "
                              f"more than {hf_dir}'s vocab_size = {hf_vocab}", "data.tokenizer")
        info["tokenizer"] = record = tokenizer_record(tokenizer)
        if found is not None:  # named as it will be: the finished seed's copy
            data = dataclasses.replace(data, tokenizer=str(out / found[0].name))
            record["name"] = data.tokenizer
    model = cfg.model
    if not model.vocab_size and (not info or info["tokenizer"]["vocab_size"] != hf_vocab):
        model = dataclasses.replace(model, vocab_size=hf_vocab)  # the seed's rows, not fewer
    (tmp / "config.toml").write_text(to_toml(dataclasses.replace(cfg, data=data, model=model)))
    return info


def load_hf_weights(model: nn.Module, hf_dir: str | Path) -> None:
    """Initialize a (possibly sharded) model in place from a HF folder.

    Every rank reads the full tensors (safetensors maps them lazily) and keeps its own shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    adapter = adapter_for_hf(read_hf_config(hf_dir))
    if not isinstance(model, adapter.model_cls):
        raise ConfigError(f"{hf_dir} holds a {adapter.model_type!r} model but the run builds a "
                          f"{type(model).__name__}; set model.name to match")
    weights = convert_from_hf(hf_dir, adapter, model.args)
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, weights, options=options)


# ---------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.checkpoint.hf",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    overrides_note = "Other --section.key=value arguments override the run's config."
    p = sub.add_parser("export", help="DCP checkpoint -> Hugging Face model folder",
                       epilog=overrides_note)
    p.add_argument("--checkpoint", required=True, help="run folder, checkpoint folder or step-<N>")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                   help="weights dtype (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="unpadded vocab (default: model.vocab_size, else the run's tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA run: a PEFT adapter folder, its base model in OUT/base "
                        "(default: the merged model)")
    p = sub.add_parser("import", help="Hugging Face model folder -> DCP seed checkpoint",
                       epilog="The target model comes from --job.config_file FILE and other "
                              "--section.key=value config overrides.")
    p.add_argument("--hf", required=True, help="folder with config.json and safetensors weights")
    p.add_argument("--out", required=True, help="new step-<N> folder to write")
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="float32",
                   help="dtype of the saved weights")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.command == "export" and args.adapter:
            from torchllm.checkpoint.hf_lora import export_adapter

            export_adapter(args.checkpoint, args.out, overrides, args.dtype,
                           parse_size(args.max_shard_size), args.vocab_size, args.overwrite)
        elif args.command == "export":
            export_hf(args.checkpoint, args.out, overrides, args.dtype,
                      parse_size(args.max_shard_size), args.vocab_size, args.overwrite)
        else:
            import_hf(args.hf, args.out, overrides, args.dtype, args.overwrite)
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
