"""torch.optim.Muon with its Newton-Schulz iteration in a chosen dtype.

torch's Muon orthogonalizes every update in bf16. Where bf16 matmuls are native (CUDA, CPUs with
AVX512_BF16/AMX) that is its fast path; on a CPU without them each bf16 matmul falls back to a
reference kernel ~20x slower than float32 (measured on an AVX2 AMD EPYC: 445 vs 23 ms for the
5 iterations of one 512 x 128 matrix), and the optimizer step dominated a small model's training
step. `ns_dtype` keeps the iteration in float32 there. Everything else (momentum, Nesterov,
the learning-rate adjustment, decoupled weight decay, the state's `momentum_buffer`) is
torch.optim.Muon's own, so checkpoints of either load in the other.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr

from torchllm.precision import cpu_native_bf16


def newton_schulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization, computed in `dtype`."""
    a, b, c = coefficients
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def fast_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 where its matmuls are native (CUDA, a CPU with native bf16), else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_native_bf16()[0]:
        return torch.bfloat16
    return torch.float32


class Muon(torch.optim.Muon):
    def __init__(self, params, *args, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr = group["lr"].item() if torch.is_tensor(group["lr"]) else group["lr"]
            momentum = group["momentum"]
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], self.ns_dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
