"""torchllm's Muon: torch.optim.Muon with its Newton-Schulz iteration in a chosen dtype. In bf16
it is torch's optimizer bit for bit; in float32 (CPUs without native bf16, where bf16 matmuls are
~20x slower) it is the same update computed more precisely."""

from __future__ import annotations

import torch

from torchllm.optim.muon_ns import Muon, fast_ns_dtype


def _steps(opt_cls, params, grads, **kwargs):
    params = [p.detach().clone().requires_grad_() for p in params]
    opt = opt_cls(params, lr=0.02, weight_decay=0.1, momentum=0.95, **kwargs)
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
    return params, opt


def test_muon_matches_torch_in_bf16_and_float32_within_bf16_rounding():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(48, 16, generator=gen), torch.randn(16, 40, generator=gen)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    theirs, torch_opt = _steps(torch.optim.Muon, params, grads)
    ours, opt = _steps(Muon, params, grads, ns_dtype=torch.bfloat16)
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)
    for p, q in zip(torch_opt.param_groups[0]["params"], opt.param_groups[0]["params"]):
        assert torch.equal(torch_opt.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
    fp32, _ = _steps(Muon, params, grads, ns_dtype=torch.float32)
    for start, a, b in zip(params, theirs, fp32):
        moved = (a - start).abs().max()
        # The same update up to bf16's rounding of the iteration (~1% of each step's size).
        assert (a - b).abs().max() < 0.05 * moved and not torch.equal(a, b)


def test_fast_ns_dtype_is_bf16_only_where_bf16_is_native(monkeypatch):
    import torchllm.optim.muon_ns as muon

    assert fast_ns_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(muon, "cpu_native_bf16", lambda: (False, "no AVX512_BF16/AMX"))
    assert fast_ns_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(muon, "cpu_native_bf16", lambda: (True, "AMX"))
    assert fast_ns_dtype(torch.device("cpu")) == torch.bfloat16


def test_trainer_runs_newton_schulz_in_float32_on_a_cpu_without_native_bf16(tmp_path,
                                                                            monkeypatch):
    import torchllm.optim.muon_ns as muon
    from conftest import tiny_config
    from torchllm.train import Trainer

    monkeypatch.setattr(muon, "cpu_native_bf16", lambda: (False, "no AVX512_BF16/AMX"))
    trainer = Trainer(tiny_config(tmp_path, "--optimizer.name=muon", "--training.steps=1"))
    try:
        (ns,) = [o for o in trainer.optimizer.optimizers if isinstance(o, torch.optim.Muon)]
        assert isinstance(ns, Muon) and ns.ns_dtype == torch.float32
    finally:
        trainer.close()
