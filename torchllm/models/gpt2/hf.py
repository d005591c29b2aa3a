"""Hugging Face mapping for GPT-2 (`GPT2LMHeadModel`)."""

from __future__ import annotations

import torch

from torchllm.models.gpt2.args import GPT2Args
from torchllm.models.gpt2.model import GPT2
from torchllm.models.hf_common import (
    Weights, check_tied, check_vocab, expect, pad_vocab, trim_vocab,
)


class GPT2Adapter:
    """HF GPT-2 keeps GPT-2's Conv1D layout: weights are [in, out], i.e. nn.Linear's transposed,
    and q/k/v are one fused `c_attn` (split here into wq/wk/wv, re-fused on export)."""

    model_type = "gpt2"
    model_cls = GPT2
    # torchllm name inside a block -> (HF name inside `transformer.h.<i>.`, transposed?)
    BLOCK = {
        "attention_norm.weight": ("ln_1.weight", False),
        "attention_norm.bias": ("ln_1.bias", False),
        "attention.wo.weight": ("attn.c_proj.weight", True),
        "attention.wo.bias": ("attn.c_proj.bias", False),
        "ffn_norm.weight": ("ln_2.weight", False),
        "ffn_norm.bias": ("ln_2.bias", False),
        "feed_forward.w1.weight": ("mlp.c_fc.weight", True),
        "feed_forward.w1.bias": ("mlp.c_fc.bias", False),
        "feed_forward.w2.weight": ("mlp.c_proj.weight", True),
        "feed_forward.w2.bias": ("mlp.c_proj.bias", False),
    }
    QKV = ("attention.wq", "attention.wk", "attention.wv")
    # PEFT adapter export (hf_common): none
    peft_block = None
    peft_refusal = "GPT-2 fuses q/k/v into one Conv1D"

    @staticmethod
    def config(args: GPT2Args, vocab_size: int) -> dict:
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab_size,
            "n_positions": args.max_seq_len,
            "n_embd": args.dim,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "n_inner": args.ffn_hidden_dim,
            "activation_function": "gelu_new",  # HF's name for GELU with the tanh approximation
            "layer_norm_epsilon": args.norm_eps,
            "tie_word_embeddings": args.tie_embeddings,
            # torchllm trains GPT-2 without dropout.
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    @staticmethod
    def check(hf: dict, args: GPT2Args) -> None:
        for key, ours, want in (
            ("n_embd", "dim", args.dim),
            ("n_layer", "n_layers", args.n_layers),
            ("n_head", "n_heads", args.n_heads),
            ("n_positions", "max_seq_len (model.max_seq_len, else training.seq_len)",
             args.max_seq_len),
        ):
            expect(key, hf.get(key), ours, want)
        expect("n_inner", hf.get("n_inner") or 4 * hf["n_embd"], "ffn hidden dim",
                args.ffn_hidden_dim)
        act = hf.get("activation_function", "gelu_new")
        expect("activation_function", act in ("gelu_new", "gelu_pytorch_tanh"),
                "GELU (tanh)", True)
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            expect(key, bool(hf.get(key, False)), "that option", False)
        expect("scale_attn_weights", bool(hf.get("scale_attn_weights", True)),
                "1/sqrt(head_dim) attention scale", True)
        check_vocab(hf["vocab_size"], args.vocab_size)
        check_tied(bool(hf.get("tie_word_embeddings", True)), args.tie_embeddings)

    @classmethod
    def to_hf(cls, sd: Weights, args: GPT2Args, vocab_size: int) -> Weights:
        out = {
            "transformer.wte.weight": trim_vocab(sd["tok_embeddings.weight"], vocab_size),
            "transformer.wpe.weight": sd["pos_embeddings.weight"],
            "transformer.ln_f.weight": sd["norm.weight"],
            "transformer.ln_f.bias": sd["norm.bias"],
        }
        if not args.tie_embeddings:
            out["lm_head.weight"] = trim_vocab(sd["output.weight"], vocab_size)
        for i in range(args.n_layers):
            ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
            out[theirs + "attn.c_attn.weight"] = torch.cat(
                [sd[ours + name + ".weight"] for name in cls.QKV]).t().contiguous()
            out[theirs + "attn.c_attn.bias"] = torch.cat(
                [sd[ours + name + ".bias"] for name in cls.QKV])
            for name, (hf_name, transposed) in cls.BLOCK.items():
                w = sd[ours + name]
                out[theirs + hf_name] = w.t().contiguous() if transposed else w
        return out

    @staticmethod
    def hf_names(hf_sd: Weights) -> Weights:
        """The weights under the names to_hf writes (`hf_sd` itself when they are already).
        OpenAI's released GPT-2 files on the Hub were saved from the bare GPT2Model: no
        "transformer." prefix (transformers adds it back when loading them)."""
        if all(k.startswith(("transformer.", "lm_head.")) for k in hf_sd):
            return hf_sd
        return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
                for k, v in hf_sd.items()}

    @classmethod
    def from_hf(cls, hf_sd: Weights, args: GPT2Args) -> Weights:
        hf_sd = cls.hf_names(hf_sd)
        out = {
            "tok_embeddings.weight": pad_vocab(hf_sd["transformer.wte.weight"], args.vocab_size),
            "pos_embeddings.weight": hf_sd["transformer.wpe.weight"],
            "norm.weight": hf_sd["transformer.ln_f.weight"],
            "norm.bias": hf_sd["transformer.ln_f.bias"],
        }
        if not args.tie_embeddings:
            out["output.weight"] = pad_vocab(hf_sd["lm_head.weight"], args.vocab_size)
        for i in range(args.n_layers):
            ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
            qkv_w = hf_sd[theirs + "attn.c_attn.weight"].t().chunk(3)
            qkv_b = hf_sd[theirs + "attn.c_attn.bias"].chunk(3)
            for name, w, b in zip(cls.QKV, qkv_w, qkv_b):
                out[ours + name + ".weight"] = w.contiguous()
                out[ours + name + ".bias"] = b.contiguous()
            for name, (hf_name, transposed) in cls.BLOCK.items():
                w = hf_sd[theirs + hf_name]
                out[ours + name] = w.t().contiguous() if transposed else w
        return out
