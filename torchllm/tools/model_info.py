"""Print a model's size and cost as one JSON line, built on the meta device (70B fits a laptop).

    python -m torchllm.tools.model_info --job.config_file train_configs/llama3_1b.toml [overrides]
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch

from torchllm import models
from torchllm.config import ConfigError, load_config
from torchllm.metrics.flops import flops_per_token, parameter_counts
from torchllm.metrics.header import model_shape


def tokenizer_vocab_hint(cfg) -> int | None:
    """The vocab a run would get from its tokenizer, when knowable without loading one."""
    return cfg.data.tokenizer_vocab_size if cfg.data.tokenizer == "auto" else None


def model_info(cfg) -> dict:
    args = models.model_args(cfg, tokenizer_vocab_hint(cfg))
    with torch.device("meta"):
        model = models.get(cfg.model.name).build(args)
    shapes = Counter(
        (name.split(".")[-2] if "layers" in name else name.rsplit(".", 1)[0], tuple(p.shape))
        for name, p in model.named_parameters()
    )
    return {
        "model": cfg.model.name,
        "flavor": cfg.model.flavor,
        **parameter_counts(model),
        "flops_per_token": flops_per_token(model, cfg.training.seq_len),
        "seq_len": cfg.training.seq_len,
        "vocab_size": args.vocab_size,
        "layers": args.n_layers,
        "dim": args.dim,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "ffn_hidden_dim": args.ffn_hidden_dim,
        "shape": model_shape(args),
        "shapes": {f"{name} {list(shape)}": count for (name, shape), count in shapes.items()},
        "tie_embeddings": args.tie_embeddings,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        print(json.dumps(model_info(cfg)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
