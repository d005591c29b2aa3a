"""Hugging Face mapping for Llama 3 (`LlamaForCausalLM`): RoPE rows permuted between Meta's
interleaved layout and HF's half-split one."""

from __future__ import annotations

import math

import torch

from torchllm.config.job_config import ConfigError
from torchllm.log import logger
from torchllm.models.hf_common import (
    LLAMA_LIKE_ROOTS, Weights, check_tied, check_vocab, expect, module_names, pad_vocab,
    trim_vocab,
)
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer


def rope_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (x0,x1),(x2,x3).. to HF's halves (x0,x2..|x1,x3..).

    torchllm rotates consecutive pairs (Meta's layout); HF's `rotate_half` rotates element i
    with element i + head_dim/2. Permuting the rows of wq/wk makes the two compute the same.
    """
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def rope_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaAdapter:
    model_type = "llama"
    model_cls = Transformer
    # torchllm name inside a block -> HF name inside `model.layers.<i>.`
    BLOCK = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
    }
    # PEFT adapter export (hf_common: peft_block, peft_roots, peft_lora_b)
    peft_block = module_names(BLOCK)
    peft_roots = LLAMA_LIKE_ROOTS

    @staticmethod
    def peft_lora_b(module: str, b: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
        """A LoRA update B @ A changes W's rows through B: the row permutation to_hf applies to
        wq and wk (RoPE's interleaved pairs -> HF's halves) applies to lora_B's rows."""
        if module in ("attention.wq", "attention.wk"):
            return rope_meta_to_hf(b, args.n_heads if module == "attention.wq"
                                   else args.n_kv_heads)
        return b

    @staticmethod
    def config(args: LlamaArgs, vocab_size: int) -> dict:
        """config.json in the form the Hub's Llama 3 configs use (read by transformers 4 and 5)."""
        rope_scaling = None
        if args.rope_scaling:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": args.rope_scaling_factor,
                "low_freq_factor": args.rope_low_freq_factor,
                "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_pos,
            }
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            # Llama-3.1 scaling is defined relative to the original context, so never claim less.
            "max_position_embeddings": max(args.max_seq_len, args.rope_original_max_pos)
            if args.rope_scaling else args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": args.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
        }

    @staticmethod
    def check(hf: dict, args: LlamaArgs) -> None:
        """Raise ConfigError when the HF model is not the torchllm model `args` describes."""
        for key, ours, want in (
            ("hidden_size", "dim", args.dim),
            ("num_hidden_layers", "n_layers", args.n_layers),
            ("num_attention_heads", "n_heads", args.n_heads),
            ("num_key_value_heads", "n_kv_heads", args.n_kv_heads),  # absent/None = MHA
            ("intermediate_size", "ffn hidden dim", args.ffn_hidden_dim),
        ):
            value = hf.get(key)
            if key == "num_key_value_heads" and value is None:
                value = hf["num_attention_heads"]
            expect(key, value, ours, want)
        expect("head_dim", hf.get("head_dim") or args.head_dim, "head_dim", args.head_dim)
        expect("hidden_act", hf.get("hidden_act", "silu"), "activation", "silu")
        for key in ("attention_bias", "mlp_bias"):
            expect(key, bool(hf.get(key, False)), "biases", False)
        check_vocab(hf["vocab_size"], args.vocab_size)
        check_tied(bool(hf.get("tie_word_embeddings", False)), args.tie_embeddings)
        # transformers 5 writes rope_parameters; 4.x and the Hub's configs rope_theta/rope_scaling.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if not math.isclose(theta, args.rope_theta):
            raise ConfigError(
                f"Hugging Face rope_theta = {theta} but the torchllm model has rope_theta = "
                f"{args.rope_theta}; set model.rope_theta = {theta}"
            )
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ConfigError(f"Hugging Face rope type {kind!r} is not supported (default, llama3)")
        expect("rope type", kind == "llama3", "rope_scaling", args.rope_scaling)
        if args.rope_scaling:
            for key, ours in (
                ("factor", "rope_scaling_factor"),
                ("low_freq_factor", "rope_low_freq_factor"),
                ("high_freq_factor", "rope_high_freq_factor"),
                ("original_max_position_embeddings", "rope_original_max_pos"),
            ):
                expect(f"rope {key}", rope.get(key), ours, getattr(args, ours))
        eps = hf.get("rms_norm_eps", args.norm_eps)
        if not math.isclose(eps, args.norm_eps):
            logger.warning("Hugging Face rms_norm_eps = %g, torchllm uses %g: logits will differ "
                           "slightly", eps, args.norm_eps)

    @classmethod
    def to_hf(cls, sd: Weights, args: LlamaArgs, vocab_size: int) -> Weights:
        out = {"model.embed_tokens.weight": trim_vocab(sd["tok_embeddings.weight"], vocab_size),
               "model.norm.weight": sd["norm.weight"]}
        if not args.tie_embeddings:
            out["lm_head.weight"] = trim_vocab(sd["output.weight"], vocab_size)
        for i in range(args.n_layers):
            for ours, theirs in cls.BLOCK.items():
                w = sd[f"layers.{i}.{ours}"]
                if ours == "attention.wq.weight":
                    w = rope_meta_to_hf(w, args.n_heads)
                elif ours == "attention.wk.weight":
                    w = rope_meta_to_hf(w, args.n_kv_heads)
                out[f"model.layers.{i}.{theirs}"] = w
        return out

    @classmethod
    def from_hf(cls, hf_sd: Weights, args: LlamaArgs) -> Weights:
        embeddings = hf_sd["model.embed_tokens.weight"]
        out = {"tok_embeddings.weight": pad_vocab(embeddings, args.vocab_size),
               "norm.weight": hf_sd["model.norm.weight"]}
        if not args.tie_embeddings:
            out["output.weight"] = pad_vocab(hf_sd["lm_head.weight"], args.vocab_size)
        for i in range(args.n_layers):
            for ours, theirs in cls.BLOCK.items():
                w = hf_sd[f"model.layers.{i}.{theirs}"]
                if ours == "attention.wq.weight":
                    w = rope_hf_to_meta(w, args.n_heads)
                elif ours == "attention.wk.weight":
                    w = rope_hf_to_meta(w, args.n_kv_heads)
                out[f"layers.{i}.{ours}"] = w
        return out
