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

Names come from the family's Hugging Face adapter (models/<family>/hf.py: `peft_block`,
`peft_roots`, `peft_lora_b`; models/hf_common.py says what each is); nothing here knows a
family. A LoRA update B @ A changes W's rows through B and its columns through A, so a family
whose export permutes W's rows permutes lora_B's the same way (`peft_lora_b`); A is unchanged.
"""

from __future__ import annotations

import torch

from torchllm.config import ConfigError
from torchllm.models import adapter_for_model, hf_adapters
from torchllm.models.lora import TOKEN_DELTA, adapter_modules, token_ids

PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


def peft_adapter(model_name: str):
    """The family's HF adapter, or a ConfigError when it has no PEFT adapter export."""
    adapter = adapter_for_model(model_name)
    if adapter.peft_block is None:
        supported = [n for n, a in hf_adapters().items() if a.peft_block is not None]
        raise ConfigError(
            f"--adapter: model.name = {model_name!r} has no PEFT adapter export (supported: "
            f"{', '.join(supported)}; {adapter.peft_refusal}); export the merged model "
            "(without --adapter)", "--adapter")
    return adapter


def peft_weights(weights: dict[str, torch.Tensor], lcfg, model_name: str, args, vocab: int
                 ) -> tuple[dict[str, torch.Tensor], list[str], list[str], dict[str, list[int]]]:
    """(PEFT state dict, HF target module names, modules_to_save, trainable_token_indices) of
    a LoRA checkpoint's weights (torchllm names), trained with the [lora] section `lcfg` on
    the family `model_name`."""
    from torchllm.models.hf_common import trim_vocab

    adapter = peft_adapter(model_name)
    block_map, roots = adapter.peft_block, adapter.peft_roots
    out, targets = {}, set()
    for name in adapter_modules(weights):
        _, layer, sub = name.split(".", 2)  # layers.<i>.<sub>
        hf = f"model.layers.{layer}.{block_map[sub]}"
        a, b = weights[f"{name}.lora_A.weight"], weights[f"{name}.lora_B.weight"]
        b = adapter.peft_lora_b(sub, b, args)  # W's rows permuted on export: so are B's
        out[f"{PREFIX}{hf}.lora_A.weight"] = a
        out[f"{PREFIX}{hf}.lora_B.weight"] = b
        targets.add(hf.rsplit(".", 1)[-1])
    saved = []
    if lcfg.train_embeddings:  # trained whole: PEFT's modules_to_save
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


def adapter_config(lcfg, targets: list[str], saved: list[str], rows: dict[str, list[int]]
                   ) -> dict:
    """adapter_config.json of the [lora] section `lcfg`. base_model_name_or_path is relative to
    the adapter folder, so the folder moves whole (transformers resolves it from the working
    directory: docs/lora.md)."""
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
