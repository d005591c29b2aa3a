"""bench_gpu.py's peer: a plain transformers `LlamaForCausalLM` training loop on the shape of
torchllm's model of the config (`--peer transformers`; bench_gpu.py runs it in its own process
as `bench_gpu.py --peer_worker OUT ...`)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchllm import models
from torchllm.config import load_config
from torchllm.tools.model_info import tokenizer_vocab_hint


def peer_model(cfg, device: torch.device):
    """transformers' Llama with torchllm's model of `cfg` (same dims, heads, SwiGLU width,
    RoPE, vocab, tied or not), random init: the same matmuls per token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = models.model_args(cfg.model, cfg.training, cfg.data,
                          tokenizer_vocab_hint(cfg.data))
    rope = None
    if getattr(m, "rope_scaling", False):
        rope = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
                "low_freq_factor": m.rope_low_freq_factor,
                "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_pos}
    hf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim,
                     intermediate_size=m.ffn_hidden_dim, num_hidden_layers=m.n_layers,
                     num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads or m.n_heads,
                     max_position_embeddings=max(cfg.training.seq_len, m.max_seq_len,
                                                 m.rope_original_max_pos),
                     rope_theta=m.rope_theta, rope_scaling=rope, rms_norm_eps=m.norm_eps,
                     tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(hf).train(), m.vocab_size


def peer_worker(out: str, config_args: list[str], steps: int, warmup: int, precision: str,
                backend: str) -> None:
    """The peer's training loop (one process): writes tokens/s, step times, losses, peak."""
    cfg = load_config(config_args)
    device = torch.device(cfg.training.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cuda
    model, vocab = peer_model(cfg, device)
    if backend != "none":
        for layer in model.model.layers:
            layer.compile(backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda)
    batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with amp:
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = times[warmup:]
    Path(out).write_text(json.dumps({
        "tokens_per_s": batch * seq * len(timed) / sum(timed),  # as torchllm's summarize
        "step_time_median_s": statistics.median(timed), "losses": losses, "vocab": vocab,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}))
