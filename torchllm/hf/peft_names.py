"""PEFT's names for a LoRA run's adapters (what `export --adapter` writes, export.export_adapter):

    adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight / lora_B.weight
                               (+ the embeddings and head with lora.train_embeddings, as
                               PEFT's modules_to_save; the added tokens' trained rows with
                               lora.train_new_tokens, as PEFT's trainable_token_indices:
                               base_model.model.<HF table>.token_adapter.trainable_tokens_delta)
    adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
                               target_modules (Hugging Face names), trainable_token_indices,
                               base_model_name_or_path = "base" (relative to the adapter
                               folder, where export writes the base: docs/lora.md)

Names come from the family's Hugging Face mapping (models/<family>/hf.py). A LoRA update
B @ A changes W's rows through B and its columns through A, so the row permutation Llama's
export applies to wq and wk (RoPE's interleaved pairs -> Hugging Face's halves) applies to
lora_B's rows; A is unchanged.
"""

from __future__ import annotations

import torch

from torchllm.config import ConfigError
from torchllm.models.lora import TOKEN_DELTA, adapter_modules, token_ids

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
                 ) -> tuple[dict[str, torch.Tensor], list[str], list[str], dict[str, list[int]]]:
    """(PEFT state dict, HF target module names, modules_to_save, trainable_token_indices) of
    a LoRA checkpoint's weights (torchllm names)."""
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
    rows = {}
    for ours, hf in roots.items():  # trained rows: PEFT replaces them by these values
        key = f"{ours}.{TOKEN_DELTA}"
        if key in weights:
            ids = token_ids(weights, key, vocab)
            table = weights[f"{ours}.weight"]
            values = table[ids[0]: ids[-1] + 1] + weights[key].to(table.dtype)
            out[f"{PREFIX}{hf}.token_adapter.trainable_tokens_delta"] = values
            rows[hf.rsplit(".", 1)[-1]] = ids
    return out, sorted(targets), saved, rows


BASE = "base"  # the base model's folder inside the adapter folder (export_adapter)


def adapter_config(cfg, targets: list[str], saved: list[str], rows: dict[str, list[int]]
                   ) -> dict:
    """adapter_config.json. base_model_name_or_path is relative to the adapter folder, so the
    folder moves whole (transformers resolves it from the working directory: docs/lora.md)."""
    lcfg = cfg.lora
    alpha = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else lcfg.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": BASE,
        "r": lcfg.rank,
        "lora_alpha": alpha,
        "lora_dropout": lcfg.dropout,
        "target_modules": targets,
        "modules_to_save": saved or None,
        "trainable_token_indices": rows or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
