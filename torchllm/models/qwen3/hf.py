"""Hugging Face mapping for Qwen3 (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

Same RoPE layout as Hugging Face (no permutation). Experts are written in the Hub's per-expert
layout (`mlp.experts.<e>.{gate,up,down}_proj.weight`, read by transformers 4 and 5) and read
from it or from transformers 5's fused one (`mlp.experts.gate_up_proj` [E, 2I, D],
`mlp.experts.down_proj` [E, D, I]).
"""

from __future__ import annotations

import math

import torch

from torchllm.config.job_config import ConfigError
from torchllm.log import logger
from torchllm.models.hf_common import (
    LLAMA_LIKE_ROOTS, Weights, check_tied, check_vocab, expect, module_names, pad_vocab,
    same_lora_b, trim_vocab,
)
from torchllm.models.qwen3.args import Qwen3Args
from torchllm.models.qwen3.model import Qwen3

ATTENTION = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Qwen3Adapter:
    model_type = "qwen3"
    model_cls = Qwen3
    moe = False
    # PEFT adapter export (hf_common): Qwen's RoPE layout is HF's, so lora_B is unchanged
    peft_block = module_names({**ATTENTION, **DENSE})
    peft_roots = LLAMA_LIKE_ROOTS
    peft_lora_b = staticmethod(same_lora_b)

    @classmethod
    def config(cls, args: Qwen3Args, vocab_size: int) -> dict:
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM" if cls.moe else "Qwen3ForCausalLM"],
            "model_type": cls.model_type,
            "vocab_size": vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": args.tie_embeddings,
            "attention_bias": False,
            "use_sliding_window": False,
        }
        if cls.moe:
            cfg.update({
                "num_experts": args.n_experts,
                "num_experts_per_tok": args.n_experts_per_tok,
                "moe_intermediate_size": args.moe_hidden_dim,
                "norm_topk_prob": args.norm_topk_prob,
                "decoder_sparse_step": args.moe_every,
                "mlp_only_layers": [],
            })
        return cfg

    @classmethod
    def check(cls, hf: dict, args: Qwen3Args) -> None:
        keys = [("hidden_size", "dim", args.dim), ("num_hidden_layers", "n_layers", args.n_layers),
                ("num_attention_heads", "n_heads", args.n_heads),
                ("num_key_value_heads", "n_kv_heads", args.n_kv_heads),
                ("head_dim", "head_dim", args.head_dim),
                ("intermediate_size", "hidden_dim", args.hidden_dim)]
        if cls.moe:
            keys += [("num_experts", "n_experts", args.n_experts),
                     ("num_experts_per_tok", "n_experts_per_tok", args.n_experts_per_tok),
                     ("moe_intermediate_size", "moe_hidden_dim", args.moe_hidden_dim),
                     ("norm_topk_prob", "norm_topk_prob", args.norm_topk_prob),
                     ("decoder_sparse_step", "moe_every", args.moe_every)]
            if hf.get("mlp_only_layers"):
                raise ConfigError("Hugging Face mlp_only_layers is not supported (torchllm places "
                                  "MoE blocks every model.moe_every layers)")
        aliases = {"num_experts": "num_local_experts"}  # transformers 5 writes the latter
        for key, ours, want in keys:
            expect(key, hf.get(key, hf.get(aliases.get(key, ""))), ours, want)
        expect("attention_bias", bool(hf.get("attention_bias", False)), "biases", False)
        check_vocab(hf["vocab_size"], args.vocab_size)
        check_tied(bool(hf.get("tie_word_embeddings", False)), args.tie_embeddings)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if not math.isclose(theta, args.rope_theta):
            raise ConfigError(f"Hugging Face rope_theta = {theta} but the torchllm model has "
                              f"rope_theta = {args.rope_theta}; set model.rope_theta = {theta}")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"Hugging Face rope type {rope.get('rope_type')!r} is not supported "
                              "for Qwen3 (default)")

    @classmethod
    def to_hf(cls, sd: Weights, args: Qwen3Args, vocab_size: int) -> Weights:
        out = {"model.embed_tokens.weight": trim_vocab(sd["tok_embeddings.weight"], vocab_size),
               "model.norm.weight": sd["norm.weight"]}
        if not args.tie_embeddings:
            out["lm_head.weight"] = trim_vocab(sd["output.weight"], vocab_size)
        for i in range(args.n_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            for a, b in ATTENTION.items():
                out[theirs + b] = sd[ours + a]
            if args.is_moe_layer(i):
                out[theirs + "mlp.gate.weight"] = sd[ours + "feed_forward.gate.weight"]
                bias = sd.get(ours + "feed_forward.expert_bias")
                if bias is not None and bias.abs().max() > 0:  # Qwen3MoE routes without one
                    logger.warning("%s: the routing bias of aux-loss-free balancing has no "
                                   "place in Qwen3MoE; the export routes by the unbiased "
                                   "probabilities", ours + "feed_forward.expert_bias")
                for w, name in EXPERT.items():
                    stacked = sd[f"{ours}feed_forward.experts.{w}"]
                    for e in range(args.n_experts):
                        out[f"{theirs}mlp.experts.{e}.{name}.weight"] = stacked[e]
            else:
                for a, b in DENSE.items():
                    out[theirs + b] = sd[ours + a]
        return out

    @classmethod
    def from_hf(cls, hf_sd: Weights, args: Qwen3Args) -> Weights:
        out = {"tok_embeddings.weight": pad_vocab(hf_sd["model.embed_tokens.weight"],
                                                  args.vocab_size),
               "norm.weight": hf_sd["model.norm.weight"]}
        if not args.tie_embeddings:
            out["output.weight"] = pad_vocab(hf_sd["lm_head.weight"], args.vocab_size)
        for i in range(args.n_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            for a, b in ATTENTION.items():
                out[ours + a] = hf_sd[theirs + b]
            if args.is_moe_layer(i):
                out[ours + "feed_forward.gate.weight"] = hf_sd[theirs + "mlp.gate.weight"]
                if args.moe_bias_update_rate > 0:  # balancing starts from no bias
                    out[ours + "feed_forward.expert_bias"] = torch.zeros(args.n_experts)
                fused = hf_sd.get(theirs + "mlp.experts.gate_up_proj")
                if fused is not None:  # transformers 5's layout
                    out[ours + "feed_forward.experts.w1"], out[ours + "feed_forward.experts.w3"] = fused.chunk(2, 1)
                    out[ours + "feed_forward.experts.w2"] = hf_sd[theirs + "mlp.experts.down_proj"]
                    continue
                for w, name in EXPERT.items():
                    out[f"{ours}feed_forward.experts.{w}"] = torch.stack([
                        hf_sd[f"{theirs}mlp.experts.{e}.{name}.weight"]
                        for e in range(args.n_experts)])
            else:
                for a, b in DENSE.items():
                    out[ours + a] = hf_sd[theirs + b]
        return out


class Qwen3MoeAdapter(Qwen3Adapter):
    model_type = "qwen3_moe"
    moe = True
    peft_block = module_names(ATTENTION)  # LoRA targets the attention only (the experts are
    #                                       batched weights, not nn.Linear layers)
