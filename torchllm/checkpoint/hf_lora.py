"""Export a LoRA run as a PEFT adapter folder (`export --adapter`), beside its base model.

    OUT/adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
                                   lora_dropout, target_modules (Hugging Face names), and
                                   base_model_name_or_path = OUT/base
    OUT/adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight / lora_B.weight
                                   (+ the embeddings and head with lora.train_embeddings, as
                                   PEFT's modules_to_save)
    OUT/base/                      the base model as a Hugging Face folder (hf.export_hf with
                                   the adapters left out), tokenizer included

`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("OUT/base"), "OUT")`
then computes what the torchllm LoRA model computes. Names come from the family's Hugging
Face mapping (models/<family>/hf.py). A LoRA update B @ A changes W's rows through B
and its columns through A, so the row permutation Llama's export applies to wq and wk (RoPE's
interleaved pairs -> Hugging Face's halves) applies to lora_B's rows; A is unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from torchllm.checkpoint.convert import replace_dir, save_safetensors, temp_sibling
from torchllm.checkpoint.layout import EXPORT_DTYPES
from torchllm.config import ConfigError
from torchllm.models.lora import adapter_modules, is_adapter_key

PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


def module_map(model_name: str) -> tuple[dict[str, str], dict[str, str]]:
    """(torchllm name inside a block -> HF name inside `model.layers.<i>.`, torchllm root
    module -> HF root module (the embeddings and head)) for a family with adapter export."""
    from torchllm.models.llama.hf import LlamaAdapter
    from torchllm.models.qwen3.hf import ATTENTION, DENSE

    roots = {"tok_embeddings": "model.embed_tokens", "output": "lm_head"}
    blocks = {"llama3": LlamaAdapter.BLOCK, "qwen3": {**ATTENTION, **DENSE},
              "qwen3_moe": ATTENTION}
    if model_name not in blocks:
        raise ConfigError(
            f"--adapter: model.name = {model_name!r} has no PEFT adapter export (supported: "
            f"{', '.join(blocks)}; GPT-2 fuses q/k/v into one Conv1D); export the merged model "
            "(without --adapter)", "--adapter")
    strip = {k.removesuffix(".weight"): v.removesuffix(".weight")
             for k, v in blocks[model_name].items() if k.endswith(".weight")}
    return strip, roots


def peft_weights(weights: dict[str, torch.Tensor], cfg, args, vocab: int
                 ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(PEFT state dict, HF target module names, modules_to_save) of a LoRA checkpoint's
    weights (torchllm names)."""
    from torchllm.models.hf_common import trim_vocab
    from torchllm.models.llama.hf import rope_meta_to_hf

    block_map, roots = module_map(cfg.model.name)
    out, targets = {}, set()
    for name in adapter_modules(weights):
        _, layer, sub = name.split(".", 2)  # layers.<i>.<sub>
        hf = f"model.layers.{layer}.{block_map[sub]}"
        a, b = weights[f"{name}.lora_A.weight"], weights[f"{name}.lora_B.weight"]
        if cfg.model.name == "llama3" and sub in ("attention.wq", "attention.wk"):
            heads = args.n_heads if sub == "attention.wq" else args.n_kv_heads
            b = rope_meta_to_hf(b, heads)  # W's rows are permuted on export: so are B's
        out[f"{PREFIX}{hf}.lora_A.weight"] = a
        out[f"{PREFIX}{hf}.lora_B.weight"] = b
        targets.add(hf.rsplit(".", 1)[-1])
    saved = []
    if cfg.lora.train_embeddings:  # trained whole: PEFT's modules_to_save
        for ours, hf in roots.items():
            if f"{ours}.weight" in weights:
                out[f"{PREFIX}{hf}.weight"] = trim_vocab(weights[f"{ours}.weight"], vocab)
                saved.append(hf.rsplit(".", 1)[-1])
    return out, sorted(targets), saved


def adapter_config(cfg, targets: list[str], saved: list[str], base: Path) -> dict:
    lcfg = cfg.lora
    alpha = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else lcfg.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": lcfg.rank,
        "lora_alpha": alpha,
        "lora_dropout": lcfg.dropout,
        "target_modules": targets,
        "modules_to_save": saved or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def export_adapter(checkpoint, out: str | Path, overrides=(), dtype: str | None = None,
                   max_shard_bytes: int = 5 * 10**9, vocab_size: int | None = None,
                   overwrite: bool = False) -> Path:
    """Write OUT (adapter) and OUT/base (the base model) from a LoRA checkpoint; see above."""
    from torchllm import models
    from torchllm.checkpoint.convert import load_dcp_weights
    from torchllm.checkpoint.hf import _run_config, export_hf
    from torchllm.checkpoint.layout import resolve_checkpoint

    if "://" in str(out):
        raise ConfigError("--adapter writes a local folder; export to a path, then upload it",
                          "--out")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass --overwrite to replace it, or export "
                              "into a new folder")
    step_path = resolve_checkpoint(checkpoint)
    cfg = _run_config(step_path, list(overrides))
    if not cfg.lora.enable:
        raise ConfigError(f"--adapter: checkpoint {step_path} is not a LoRA run (lora.enable = "
                          "false); export it without --adapter", "--adapter")
    module_map(cfg.model.name)  # refuse an unsupported family before writing anything
    final, tmp = out.absolute(), temp_sibling(out, "adapter-tmp")
    try:
        tmp.mkdir()
        base = export_hf(step_path, tmp / "base", overrides, dtype, max_shard_bytes, vocab_size,
                         lora="base")
        vocab = json.loads((base / "config.json").read_text())["vocab_size"]
        weights = {k: v for k, v in load_dcp_weights(step_path).items()
                   if is_adapter_key(k) or not k.startswith("layers.")}
        args = models.model_args(cfg, vocab)
        tensors, targets, saved = peft_weights(weights, cfg, args, vocab)
        if dtype is not None:
            tensors = {k: v.to(EXPORT_DTYPES[dtype]) for k, v in tensors.items()}
        save_safetensors({k: v.contiguous() for k, v in tensors.items()},
                         tmp / "adapter_model.safetensors", {"format": "pt"})
        config = adapter_config(cfg, targets, saved, final / "base")
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
