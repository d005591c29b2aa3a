"""Export a checkpoint as a `transformers` model folder (`python -m torchllm.hf export`).

The step is opened by the checkpoint reader (checksums, data-only metadata, newest healthy step
of a run folder, tokenizer identity) and exported under the config it was written under (the
step folder's `config.toml`, else the run's): `config.json`, `model.safetensors` (sharded with
an index over the size limit), `generation_config.json` and the run's tokenizer (SentencePiece,
tiktoken as a tokenizer.json, or tokenizer.json; with the chat template a chat run trained
with: tokenizer.py), a folder `from_pretrained` loads. A LoRA run exports merged, or
(`--adapter`) as a PEFT adapter folder beside its base model (peft_names.py names the modules).
It is written beside the output and renamed when complete; an existing output is refused
unless --overwrite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torchllm import models
from torchllm.checkpoint import EXPORT_DTYPES, Step, open_checkpoint
from torchllm.models import adapter_for_model
from torchllm.config import ConfigError, load_config
from torchllm.hf.files import replace_dir, save_safetensors, temp_sibling
from torchllm.hf.folder import EXPORT_FILE, write_hf_weights
from torchllm.hf.peft_names import adapter_config, peft_adapter, peft_weights
from torchllm.hf.tokenizer import write_tokenizer
from torchllm.hf.validate import check_export_dtypes
from torchllm.log import logger
from torchllm.models.lora import is_adapter_key, plain_weights
from torchllm.storage import is_url, join, storage_for


def _opened(checkpoint: str | Path | Step) -> Step:
    """The checkpoint opened by the reader: checksums, data-only metadata, the newest healthy
    step of a run folder (a reader is already open)."""
    return checkpoint if isinstance(checkpoint, Step) else open_checkpoint(checkpoint)


def run_config(reader: Step, overrides: list[str]):
    """The config the step was written under: the step folder's config.toml, else the run's
    (run/<folder>/step-N -> run/config.toml)."""
    if any(a.startswith("--job.config_file") for a in overrides):
        cfg = load_config(overrides)  # the user's own config
    else:
        cfg = reader.config(overrides)  # the checkpoint's, as data (no code imported)
    saved = reader.saved_config_text()
    if saved is not None:  # its weights load only into the family they were trained as
        models.check_family(saved, cfg.model.name, f"checkpoint {reader.path}")
    return cfg


def _trained_on_chat(dcfg) -> bool:
    """Whether the run trained on conversations (`dcfg`: its [data] section; its export then
    carries a chat template)."""
    from torchllm.config.job_config import reads_conversations

    return bool(dcfg.chat_tokens) or reads_conversations(dcfg)


def _tokenizer_of(dcfg, ccfg, reader: Step, run_folder: Path):
    """The run's tokenizer (`dcfg`, `ccfg`: its [data] and [checkpoint] sections; an 'auto' one
    cached in `run_folder`'s data folder), checked against the one the step records; never
    trained here (a missing one is a one-line ConfigError)."""
    from torchllm.run.tokenizer import inference_tokenizer

    return inference_tokenizer(dcfg, ccfg, reader, run_folder / "data")


def export_hf(checkpoint: str | Path | Step, out: str | Path,
              overrides: list[str] = (),
              dtype: str | None = None, max_shard_bytes: int = 5 * 10**9,
              vocab_size: int | None = None, overwrite: bool = False,
              lora: str = "merge") -> Path:
    """Write a Hugging Face model folder from a DCP checkpoint (a path, or a step the reader
    opened); returns the folder. A LoRA run's model is merged (W + alpha/rank * B @ A), or with
    lora="base" its base alone. An fsspec URL `out` (s3://bucket/prefix) gets a local export
    uploaded file by file, config.json last.

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
    reader = _opened(checkpoint)
    step_path = reader.path
    cfg = run_config(reader, list(overrides))
    adapter = adapter_for_model(cfg.model.name)
    tokenizer = _tokenizer_of(cfg.data, cfg.checkpoint, reader, reader.run_folder(cfg.job))
    vocab = vocab_size or cfg.model.vocab_size or (tokenizer.vocab_size if tokenizer else None)
    if vocab is None:
        raise ConfigError("the unpadded vocab size is unknown (no model.vocab_size, tokenizer not "
                          "found); pass --vocab-size")
    args = models.model_args(cfg.model, cfg.training, cfg.data, vocab)
    weights = reader.weights()
    check_export_dtypes(weights, step_path)  # real floats only, before any merge or cast
    weights = plain_weights(weights, cfg.lora, merge=lora == "merge", vocab=vocab)
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
                      chat=_trained_on_chat(cfg.data), sampling=cfg.eval)
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
        if what := write_tokenizer(tokenizer, out, config, chat):
            logger.info("wrote the tokenizer: %s", what)
        else:
            logger.warning("tokenizer %s cannot be exported: no tokenizer files written",
                           type(tokenizer).__name__)
    write_hf_weights(hf_weights, out, max_shard_bytes)
    if sampling is not None:
        (out / "generation_config.json").write_text(
            json.dumps(generation_config(config, sampling), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_adapter(checkpoint, out: str | Path, overrides=(), dtype: str | None = None,
                   max_shard_bytes: int = 5 * 10**9, vocab_size: int | None = None,
                   overwrite: bool = False) -> Path:
    """Write OUT (a PEFT adapter folder) and OUT/base (the base model) from a LoRA checkpoint:

        OUT/adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
                                       lora_dropout, target_modules (Hugging Face names),
                                       trainable_token_indices (lora.train_new_tokens), and
                                       base_model_name_or_path = "base" (relative to OUT)
        OUT/adapter_model.safetensors  the adapters under PEFT's names (peft_names.py)
        OUT/base/                      the base model (export_hf with the adapters left out)

    `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("OUT/base"), "OUT")`
    then computes what the torchllm LoRA model computes."""
    if "://" in str(out):
        raise ConfigError("--adapter writes a local folder; export to a path, then upload it",
                          "--out")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it, or export "
                              "into a new folder")
    reader = _opened(checkpoint)
    step_path = reader.path
    cfg = run_config(reader, list(overrides))
    if not cfg.lora.enable:
        raise ConfigError(f"--adapter: checkpoint {step_path} is not a LoRA run (lora.enable = "
                          "false); export it without --adapter", "--adapter")
    peft_adapter(cfg.model.name)  # refuse a family without PEFT export before writing anything
    final, tmp = out.absolute(), temp_sibling(out, "adapter-tmp")
    try:
        tmp.mkdir()
        base = export_hf(reader, tmp / "base", overrides, dtype, max_shard_bytes, vocab_size,
                         lora="base")
        vocab = json.loads((base / "config.json").read_text())["vocab_size"]
        weights = {k: v for k, v in reader.weights().items()
                   if is_adapter_key(k) or not k.startswith("layers.")}
        args = models.model_args(cfg.model, cfg.training, cfg.data, vocab)
        tensors, targets, saved, rows = peft_weights(weights, cfg.lora, cfg.model.name, args,
                                                    vocab)
        if dtype is not None:
            tensors = {k: v.to(EXPORT_DTYPES[dtype]) for k, v in tensors.items()}
        save_safetensors({k: v.contiguous() for k, v in tensors.items()},
                         tmp / "adapter_model.safetensors", {"format": "pt"})
        config = adapter_config(cfg.lora, targets, saved, rows)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
