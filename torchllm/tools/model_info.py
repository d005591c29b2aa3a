"""Print a model's size and cost, built on the meta device (70B fits a laptop): a table, or
one JSON line with --json.

    python -m torchllm.tools.model_info --job.config_file train_configs/llama3_1b.toml [--json]
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


def tokenizer_vocab_hint(dcfg) -> int | None:
    """The vocab a run would get from its tokenizer, when knowable without loading one, by its
    [data] section."""
    return dcfg.tokenizer_vocab_size if dcfg.tokenizer in ("auto", "train") else None


def model_info(mcfg, tcfg, dcfg) -> dict:
    """The tool's report of the model of a run's [model] `mcfg`, [training] `tcfg` (seq_len)
    and [data] `dcfg` (the tokenizer's vocab, when knowable without loading it)."""
    args = models.model_args(mcfg, tcfg, dcfg, tokenizer_vocab_hint(dcfg))
    with torch.device("meta"):
        model = models.get(mcfg.name).build(args)
    shapes = Counter(
        (name.split(".")[-2] if "layers" in name else name.rsplit(".", 1)[0], tuple(p.shape))
        for name, p in model.named_parameters()
    )
    return {
        "model": mcfg.name,
        "flavor": mcfg.flavor,
        **parameter_counts(model),
        "flops_per_token": flops_per_token(model, tcfg.seq_len),
        "seq_len": tcfg.seq_len,
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


def pop_flag(argv: list[str], flag: str) -> bool:
    """Remove a bare `flag` (e.g. --json) from argv; whether it was there."""
    found = flag in argv
    while flag in argv:
        argv.remove(flag)
    return found


def info_table(info: dict) -> str:
    """model_info() as a few readable lines and a table of the parameter tensors."""
    active = (f", {info['active_params']:,} active per token" if "active_params" in info
              else "")
    lines = [
        f"{info['model']}/{info['flavor']}",
        f"  parameters       {info['params']:,} ({info['non_embedding_params']:,} "
        f"non-embedding{active})",
        f"  FLOPs / token    {info['flops_per_token'] / 1e6:,.1f} M (training: forward + "
        f"backward, seq_len {info['seq_len']})",
        f"  vocab            {info['vocab_size']:,}",
        f"  layers           {info['layers']}",
        f"  shape            {info['shape']}",
        f"  tied embeddings  {'yes' if info['tie_embeddings'] else 'no'}",
        "",
        f"  {'tensor':<24}{'shape':<20}{'count':>6}{'params':>16}",
    ]
    for key, count in info["shapes"].items():
        name, shape = key.split(" ", 1)
        n = count
        for d in json.loads(shape):
            n *= d
        lines.append(f"  {name:<24}{shape:<20}{count:>6}{n:>16,}")
    return "\n".join(lines)


def asks_help(argv: list[str], doc: str | None) -> bool:
    """`--help` / `-h`: print a tool's usage (its module doc) and where the config keys are
    listed; whether it was asked (the tool then exits 0)."""
    if "--help" not in argv and "-h" not in argv:
        return False
    print((doc or "").strip())
    print("\nEvery --section.key=value of the training config is accepted (the same keys as "
          "./run_train.sh; `python -m torchllm.train --help` lists them with their defaults).")
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_help(argv, __doc__):
        return 0
    as_json = pop_flag(argv, "--json")
    try:
        cfg = load_config(argv)
        info = model_info(cfg.model, cfg.training, cfg.data)
        print(json.dumps(info) if as_json else info_table(info))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
