"""Shared test builders (tests/builders/models.py): imported by the test modules that use them."""

from __future__ import annotations

import torch


VOCAB = 100  # unpadded; the torchllm models below pad it to 128


SEQ = 24


TOL = 1e-4


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def peft_model(base_dir, adapter):
    """peft's PeftModel of `adapter` on the transformers model in `base_dir`, float32, eval."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter).eval()


class EmulatedFloat8Matmul(torch.autograd.Function):
    """x @ w.T with torchao's tensorwise recipe, written out by hand: x and w cast to e4m3, the
    output gradient to e5m2, each with one dynamic scale max(dtype) / amax(tensor)."""

    @staticmethod
    def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        amax = t.detach().abs().max().double().clamp(min=1e-12)
        scale = (torch.finfo(dtype).max / amax).float()
        limit = torch.finfo(dtype).max
        return (t.float() * scale).clamp(-limit, limit).to(dtype).float() / scale

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        e4m3 = torch.float8_e4m3fn
        return EmulatedFloat8Matmul.cast(x, e4m3) @ EmulatedFloat8Matmul.cast(w, e4m3).T

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        cast = EmulatedFloat8Matmul.cast
        g = cast(grad.reshape(-1, grad.shape[-1]), torch.float8_e5m2)
        grad_x = (g @ cast(w, torch.float8_e4m3fn)).reshape(x.shape)
        grad_w = g.T @ cast(x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn)
        return grad_x, grad_w


def layout_dims(cfg, world: int, device_type: str = "cpu", args=None):
    """The product's build_parallel_dims on a test's whole config: its layout sections by name,
    `args` the config's own model args unless given."""
    from torchllm import models
    from torchllm.parallel import build_parallel_dims

    if args is None:
        args = models.model_args(cfg.model, cfg.training, cfg.data)
    return build_parallel_dims(world, device_type, args, parallelism=cfg.parallelism,
                               model=cfg.model, training=cfg.training, data=cfg.data,
                               eval=cfg.eval, float8=cfg.float8,
                               activation_checkpoint=cfg.activation_checkpoint, lora=cfg.lora,
                               compile=cfg.compile)


def plan_of(cfg):
    """The ParallelPlan of a test's whole config (ParallelPlan.of its sections)."""
    from torchllm.parallel import ParallelPlan

    return ParallelPlan.of(parallelism=cfg.parallelism, float8=cfg.float8,
                           activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile,
                           training=cfg.training)
