"""Weight-name and layout mapping between torchllm models and their Hugging Face counterparts.

One adapter per model family: the `config.json` it writes, the checks that a Hugging Face
config fits a torchllm model's args, and the state-dict conversion both ways. Conversions are
pure reshapes, transposes, splits and concatenations, so a round trip is bit-identical.
Padded vocab rows are dropped on the way out and zero-filled on the way in.
"""

from __future__ import annotations

import math

import torch

from torchllm.config.job_config import ConfigError
from torchllm.log import logger
from torchllm.models.gpt2.args import GPT2Args
from torchllm.models.gpt2.model import GPT2
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer

Weights = dict[str, torch.Tensor]


def trim_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return weight[:vocab_size]


def pad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Zero rows for the padded ids: the tokenizer never produces them."""
    extra = vocab_size - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])])


def _expect(key: str, value, ours: str, want) -> None:
    """A Hugging Face config value must equal the torchllm one it maps to."""
    if value != want:
        raise ConfigError(
            f"Hugging Face config {key} = {value!r} but the torchllm model has {ours} = {want!r}; "
            f"pick a flavor or [model] overrides that match the checkpoint"
        )


def _check_vocab(hf_vocab: int, vocab_size: int) -> None:
    if hf_vocab > vocab_size:
        raise ConfigError(
            f"Hugging Face config vocab_size = {hf_vocab} is larger than the torchllm model's "
            f"padded vocab {vocab_size}; set model.vocab_size = {hf_vocab} (or unset it)"
        )


def _check_tied(hf_tied: bool, tied: bool) -> None:
    if hf_tied != tied:
        raise ConfigError(
            f"Hugging Face config tie_word_embeddings = {hf_tied} but the torchllm model has "
            f"tie_embeddings = {tied}; set model.tie_embeddings = {str(hf_tied).lower()}"
        )


# ---------------------------------------------------------------------------------- Llama


def _rope_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (x0,x1),(x2,x3).. to HF's halves (x0,x2..|x1,x3..).

    torchllm rotates consecutive pairs (Meta's layout); HF's `rotate_half` rotates element i
    with element i + head_dim/2. Permuting the rows of wq/wk makes the two compute the same.
    """
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
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
            _expect(key, value, ours, want)
        _expect("head_dim", hf.get("head_dim") or args.head_dim, "head_dim", args.head_dim)
        _expect("hidden_act", hf.get("hidden_act", "silu"), "activation", "silu")
        for key in ("attention_bias", "mlp_bias"):
            _expect(key, bool(hf.get(key, False)), "biases", False)
        _check_vocab(hf["vocab_size"], args.vocab_size)
        _check_tied(bool(hf.get("tie_word_embeddings", False)), args.tie_embeddings)
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
        _expect("rope type", kind == "llama3", "rope_scaling", args.rope_scaling)
        if args.rope_scaling:
            for key, ours in (
                ("factor", "rope_scaling_factor"),
                ("low_freq_factor", "rope_low_freq_factor"),
                ("high_freq_factor", "rope_high_freq_factor"),
                ("original_max_position_embeddings", "rope_original_max_pos"),
            ):
                _expect(f"rope {key}", rope.get(key), ours, getattr(args, ours))
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
                    w = _rope_meta_to_hf(w, args.n_heads)
                elif ours == "attention.wk.weight":
                    w = _rope_meta_to_hf(w, args.n_kv_heads)
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
                    w = _rope_hf_to_meta(w, args.n_heads)
                elif ours == "attention.wk.weight":
                    w = _rope_hf_to_meta(w, args.n_kv_heads)
                out[f"layers.{i}.{ours}"] = w
        return out


# ---------------------------------------------------------------------------------- GPT-2


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
            _expect(key, hf.get(key), ours, want)
        _expect("n_inner", hf.get("n_inner") or 4 * hf["n_embd"], "ffn hidden dim",
                args.ffn_hidden_dim)
        act = hf.get("activation_function", "gelu_new")
        _expect("activation_function", act in ("gelu_new", "gelu_pytorch_tanh"),
                "GELU (tanh)", True)
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            _expect(key, bool(hf.get(key, False)), "that option", False)
        _expect("scale_attn_weights", bool(hf.get("scale_attn_weights", True)),
                "1/sqrt(head_dim) attention scale", True)
        _check_vocab(hf["vocab_size"], args.vocab_size)
        _check_tied(bool(hf.get("tie_word_embeddings", True)), args.tie_embeddings)

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

    @classmethod
    def from_hf(cls, hf_sd: Weights, args: GPT2Args) -> Weights:
        # OpenAI's released GPT-2 files on the Hub were saved from the bare GPT2Model: no
        # "transformer." prefix (transformers adds it back when loading them).
        hf_sd = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
                 for k, v in hf_sd.items()}
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


ADAPTERS = {"llama3": LlamaAdapter, "gpt2": GPT2Adapter}  # by torchllm model name


def _adapters() -> dict:
    """Every adapter by torchllm model name (families in their own modules register late, as
    they import this one)."""
    from torchllm.checkpoint.hf_qwen3 import Qwen3Adapter, Qwen3MoeAdapter

    return {**ADAPTERS, "qwen3": Qwen3Adapter, "qwen3_moe": Qwen3MoeAdapter}


def adapter_for_model(model_name: str):
    adapters = _adapters()
    if model_name not in adapters:
        raise ConfigError(f"model.name = {model_name!r} has no Hugging Face conversion; "
                          f"supported: {', '.join(adapters)}")
    return adapters[model_name]


def adapter_for_hf(hf_config: dict):
    by_type = {a.model_type: a for a in _adapters().values()}  # by HF config model_type
    kind = hf_config.get("model_type")
    if kind not in by_type:
        raise ConfigError(f"Hugging Face model_type {kind!r} is not supported; "
                          f"supported: {', '.join(by_type)}")
    return by_type[kind]
