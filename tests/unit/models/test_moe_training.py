"""The MoE model under the speed-ups and the run machinery: activation checkpointing, compile,
float8 (CPU-emulated), checkpoint resume with the balancing bias."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchllm.config import load_config
from torchllm.metrics.moe_stats import MoEBiasBalancer
from torchllm.models.moe import moe_layers, update_expert_bias
from torchllm.models.qwen3 import Qwen3, Qwen3Args
from torchllm.train import Trainer

from conftest import tiny_config

# 16 experts: the router Linear (64 -> 16) has float8-eligible dims, so the test below sees that
# it is kept out on purpose.
ARGS = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                 vocab_size=128, max_seq_len=16, n_experts=16, n_experts_per_tok=2,
                 moe_hidden_dim=32, moe_bias_update_rate=0.01)


def tiny_moe() -> Qwen3:
    torch.manual_seed(0)
    model = Qwen3(ARGS)
    model.init_weights()
    return model


def batch(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module, tokens: torch.Tensor):
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(),
                                       tokens.roll(-1, 1).flatten())
    loss.backward()
    clean = lambda n: n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731
    return loss.detach(), {clean(n): p.grad for n, p in model.named_parameters()}


def moes(model):
    return [m for m in model.modules() if hasattr(m, "expert_bias")]


def assert_same_step(model, ref, rel: float = 1e-5):
    """Loss, every gradient and the balancing update of one step equal the reference's."""
    tokens = batch()
    ref_loss, ref_grads = loss_and_grads(ref, tokens)
    loss, grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=rel, atol=0)
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert ((grads[name] - grad).norm() / grad.norm()).item() < rel, name
    update_expert_bias(moes(ref), 0.01)
    update_expert_bias(moes(model), 0.01)
    for a, b in zip(moes(model), moes(ref)):
        assert torch.equal(a.expert_bias, b.expert_bias)
    assert any(m.expert_bias.abs().sum() > 0 for m in moes(ref))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_equals_no_ac(mode):
    """The recomputed forward routes the same tokens; counting them twice leaves the balancing
    update (a sign of load - mean) unchanged."""
    from torchllm.parallel.ac import apply_ac

    model, ref = tiny_moe(), tiny_moe()
    cfg = load_config([f"--activation_checkpoint.mode={mode}"])
    assert apply_ac(model, cfg.activation_checkpoint)
    assert_same_step(model, ref)


@pytest.mark.slow
def test_per_block_compile_equals_eager():
    from torchllm.parallel.compile import apply_compile

    model, ref = tiny_moe(), tiny_moe()
    cfg = load_config(["--compile.enable", "--compile.backend=aot_eager"])
    assert apply_compile(model, cfg.compile) == ARGS.n_layers
    assert_same_step(model, ref)


def test_float8_converts_attention_not_router_or_experts():
    """Emulated float8 (tensorwise): the attention Linears run float8 matmuls; the router and
    the grouped experts stay in high precision. Loss and gradients equal the same model whose
    converted Linears run a hand-written float8 emulation (test_parallel's), to 1e-5."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from torchllm.parallel.float8 import apply_float8

    from builders.models import EmulatedFloat8Matmul

    model, ref = tiny_moe(), tiny_moe()
    cfg = load_config(["--float8.enable", "--float8.emulate", "--float8.recipe=tensorwise"])
    converted = apply_float8(model, cfg.float8, "cpu", fsdp_enabled=False)
    expected = {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert set(converted) == expected
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == expected
    for name in converted:
        linear = ref.get_submodule(name)
        linear.forward = lambda x, w=linear.weight: EmulatedFloat8Matmul.apply(x, w)
    assert_same_step(model, ref)
    plain_loss, _ = loss_and_grads(tiny_moe(), batch())
    assert loss_and_grads(model, batch())[0] != plain_loss  # the float8 casts really ran


RUN = ("--model.name=qwen3_moe", "--model.moe_bias_update_rate=0.01", "--training.steps=4",
       "--checkpoint.enable", "--checkpoint.interval=100", "--job.deterministic",
       "--job.run_name=run")


def test_resume_restores_the_expert_bias_and_continues_bit_for_bit(tmp_path):
    """4 steps straight == 2 steps, save, resume, 2 steps: losses, weights and routing biases."""
    straight = Trainer(tiny_config(tmp_path / "a", *RUN))
    straight_losses = straight.train()
    first = Trainer(tiny_config(tmp_path / "b", *RUN, "--training.stop_after_steps=2"))
    losses = first.train()
    saved = [m.expert_bias.clone() for m in moe_layers(first.model)]
    assert all(0 < b.abs().max() <= 2 * 0.01 + 1e-9 for b in saved)  # two updates of 0.01
    second = Trainer(tiny_config(tmp_path / "b", *RUN, "--training.stop_after_steps=2"))
    assert second.step == 2
    for m, b in zip(moe_layers(second.model), saved):
        assert torch.equal(m.expert_bias, b)
    losses += second.train()
    assert losses == straight_losses
    for a, b in zip(moe_layers(second.model), moe_layers(straight.model)):
        assert torch.equal(a.expert_bias, b.expert_bias)
    for (name, pa), pb in zip(second.model.state_dict().items(),
                              straight.model.state_dict().values()):
        assert torch.equal(pa, pb), name
    # The bias is logged on logging steps.
    (balancer,) = [cb for cb in second.callbacks if isinstance(cb, MoEBiasBalancer)]
    report = balancer.on_step_end(second.context, 1, {"skipped": False})
    bias = torch.stack([m.expert_bias for m in moe_layers(second.model)])
    assert report.scalars["moe/expert_bias_absmax"] == pytest.approx(float(bias.abs().max()))
    assert report.scalars["moe/expert_bias/e0"] == pytest.approx(float(bias[:, 0].mean()))


def emulated_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's 2d x 3d contract, with the CUDA kernel's requirements checked: int32
    cumulative group ends, every group starting on an 8-row (16-byte bf16) boundary, the groups
    covering every row of `a`."""
    assert offs.dtype == torch.int32 and int(offs[-1]) == a.shape[0]
    bounds = [0, *offs.tolist()]
    assert all(e % 8 == 0 for e in bounds), bounds  # the kernel's rule, not torchllm's constant
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(bounds, bounds[1:]))])


@pytest.mark.parametrize("counts", [[5, 0, 11, 1], [8, 8, 0, 0], [0, 0, 0, 3]])
def test_grouped_mm_path_pads_groups_and_equals_the_padded_path(monkeypatch, counts):
    """The CUDA path (torch._grouped_mm, Hopper + bf16) cannot run here: run its index logic
    through an emulation that enforces the kernel's alignment, against the CPU path."""
    from torchllm.models import moe

    torch.manual_seed(0)
    experts = moe.GroupedExperts(4, 16, 24)
    experts.init_weights(1.0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 16)
    grad = torch.randn(x.shape[0], 16)
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(moe, "use_grouped_mm", lambda t: grouped)
        monkeypatch.setattr(torch, "_grouped_mm", emulated_grouped_mm, raising=False)
        xi = x.clone().requires_grad_()
        experts.zero_grad()
        out = experts(xi, counts)
        out.backward(grad)
        results.append([out, xi.grad, *(p.grad.clone() for p in experts.parameters())])
    for padded, grouped in zip(*results):
        torch.testing.assert_close(grouped, padded, rtol=1e-5, atol=1e-6)
