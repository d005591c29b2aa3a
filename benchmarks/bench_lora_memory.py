"""Training-state memory per rank: full fine-tuning vs LoRA, measured and estimated.

    PYTHONPATH=. python benchmarks/bench_lora_memory.py [--dim 512] [--n-layers 4]
        [--vocab 8192] [--rank 8] [--out benchmarks/results/lora_memory_cpu.json]

A CPU-sized stand-in for Llama 3.2 1B: the 1B flavor's proportions (head width 64, 4 query
heads per KV head, FFN 4 x dim) at a smaller width and depth. Each variant builds the real
Trainer (one process, fp32, AdamW), runs one step's forward and backward, then the optimizer
step, and counts the bytes of the actual tensors: the parameters, the gradients that exist
after backward, and the optimizer state after its step. LoRA freezes the base weights (no
gradients, no moments for them) and adds rank-r adapters on every attention and MLP projection.
The estimate is torchllm.tools.estimate_memory's params + grads + optimizer terms for the same
config; the table prints both and their ratio, and the JSON records them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from torchllm.config import load_config
from torchllm.tools.estimate_memory import estimate_memory
from torchllm.train import Trainer


def config_args(a, dump: str, lora: bool) -> list[str]:
    heads = max(1, a.dim // 64)
    return [
        "--model.name=llama3", "--model.flavor=1B", f"--model.dim={a.dim}",
        f"--model.n_layers={a.n_layers}", f"--model.n_heads={heads}",
        f"--model.n_kv_heads={max(1, heads // 4)}", f"--model.hidden_dim={4 * a.dim}",
        f"--model.vocab_size={a.vocab}", "--model.rope_scaling=false",
        "--data.dataset=embedded", "--data.tokenizer=bytes",
        "--training.device=cpu", "--training.mixed_precision=none", "--training.steps=1",
        f"--training.seq_len={a.seq_len}", "--training.local_batch_size=2",
        "--optimizer.name=adamw", "--optimizer.fused=off", "--metrics.report=false",
        f"--job.dump_folder={dump}", f"--job.run_name={'lora' if lora else 'full'}",
        *(["--lora.enable", f"--lora.rank={a.rank}"] if lora else []),
    ]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(a, dump: str, lora: bool) -> dict:
    """Bytes of the params, grads and optimizer state of one real training step."""
    cfg = load_config(config_args(a, dump, lora))
    trainer = Trainer(cfg)
    try:
        params = list(trainer.model.parameters())
        trainer.module.train_batch([next(trainer.batches)])
        grads = nbytes(p.grad for p in params if p.grad is not None)
        trainer.optimizer.step()
        state = nbytes(t for s in trainer.optimizer.state.values() for t in s.values()
                       if torch.is_tensor(t))
        measured = {"params": nbytes(params), "grads": grads, "optimizer": state}
        terms = estimate_memory(cfg, trainer.model_args, 1)["terms_bytes"]
        estimated = {k: terms[k] for k in measured}
        trainable = sum(p.numel() for p in params if p.requires_grad)
    finally:
        trainer.close()
    return {"variant": "LoRA" if lora else "full", "params": sum(p.numel() for p in params),
            "trainable_params": trainable, "measured_bytes": measured,
            "estimated_bytes": estimated, "measured_total": sum(measured.values()),
            "estimated_total": sum(estimated.values()),
            "ratio": sum(estimated.values()) / sum(measured.values())}


def table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [f"{'variant':8s} {'trainable':>12s} {'params':>9s} {'grads':>9s} {'optim':>9s} "
             f"{'total':>9s} {'estimate':>9s} {'est/meas':>8s}   (MiB per rank)"]
    for r in rows:
        m = r["measured_bytes"]
        lines.append(f"{r['variant']:8s} {r['trainable_params']:>12,} {m['params'] / mib:>9.2f} "
                     f"{m['grads'] / mib:>9.2f} {m['optimizer'] / mib:>9.2f} "
                     f"{r['measured_total'] / mib:>9.2f} {r['estimated_total'] / mib:>9.2f} "
                     f"{r['ratio']:>8.3f}")
    full, lora = rows
    lines.append(f"LoRA's training state is {full['measured_total'] / lora['measured_total']:.2f}x "
                 "smaller than full fine-tuning's")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/lora_memory_cpu.json")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as dump:
        rows = [measure(a, dump, lora) for lora in (False, True)]
    print(table(rows))
    result = {"shape": {"dim": a.dim, "n_layers": a.n_layers, "vocab": a.vocab,
                        "seq_len": a.seq_len, "lora_rank": a.rank},
              "device": "cpu", "world_size": 1, "runs": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
