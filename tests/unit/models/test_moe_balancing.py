"""Auxiliary-loss-free load balancing (DeepSeek-V3 style): a per-expert routing bias that steers
top-k selection (not the gates), updated after each step from the token counts summed over the
data-parallel ranks, saved with the model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from torchllm.models.moe import MoE, update_expert_bias

from conftest import spawn_gloo, tiny_config

E, DIM = 4, 8


def skewed_moe(top_k: int = 1) -> MoE:
    """A router that sends most tokens to expert 0 (its gate row is large along x's mean)."""
    torch.manual_seed(0)
    moe = MoE(DIM, 16, E, top_k, expert_bias=True)
    moe.init_weights(1.0)
    with torch.no_grad():
        moe.gate.weight[0] += 0.3
    return moe.train()


def tokens(n: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, DIM, generator=g).abs()  # positive: expert 0's row wins mostly


def brute_force_loads(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Top-k by (probability + bias), counted one token at a time."""
    loads = torch.zeros(E)
    for t in x.detach().reshape(-1, DIM):
        scores = torch.softmax(moe.gate.weight.detach() @ t, dim=-1) + moe.expert_bias
        for e in sorted(range(E), key=lambda i: -float(scores[i]))[:moe.top_k]:
            loads[e] += 1
    return loads


def test_one_update_by_hand():
    """Loads summed over two micro-batches; bias += rate * sign(mean - load), then reset."""
    moe, x1, x2 = skewed_moe(top_k=2), tokens(seed=1), tokens(seed=2)
    expected_loads = brute_force_loads(moe, x1) + brute_force_loads(moe, x2)
    assert expected_loads.max() > 1.5 * expected_loads.mean()  # really skewed
    moe(x1), moe(x2)
    loads = update_expert_bias([moe], rate=0.01)
    assert torch.equal(loads[0], expected_loads)
    mean = float(expected_loads.mean())
    by_hand = torch.tensor([0.01 * ((mean > n) - (mean < n)) for n in expected_loads.tolist()])
    assert torch.equal(moe.expert_bias, by_hand)
    assert moe.expert_bias[expected_loads.argmax()] == -0.01
    assert torch.equal(moe.expert_load, torch.zeros(E))


def test_bias_moves_the_load_towards_balance():
    moe, x = skewed_moe(), tokens(256)
    before = brute_force_loads(moe, x)
    for _ in range(150):
        moe(x)
        update_expert_bias([moe], rate=0.005)
    after = brute_force_loads(moe, x)
    assert before.max() / before.mean() > 2.5
    assert after.max() / after.mean() < 1.25, (before, after)


def test_selection_uses_the_bias_but_gates_do_not():
    moe = skewed_moe(top_k=2)
    x = tokens(32).reshape(-1, DIM)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 always chosen
        _, weights, experts = moe.route(x)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    assert (experts == 3).any(dim=-1).all()
    unbiased = probs.gather(-1, experts)
    torch.testing.assert_close(weights, unbiased / unbiased.sum(-1, keepdim=True))
    # And the layer's output: gates from the unbiased probabilities of the chosen experts.
    out = moe(x[None])[0]
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            h = torch.nn.functional.silu(moe.experts.w1[e] @ x[t]) * (moe.experts.w3[e] @ x[t])
            expected[t] += w * (moe.experts.w2[e] @ h)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_no_bias_buffer_when_off(tmp_path):
    from torchllm import models

    for rate, present in ((0.0, False), (1e-3, True)):
        cfg = tiny_config(tmp_path, "--model.name=qwen3_moe",
                          f"--model.moe_bias_update_rate={rate}")
        args = models.model_args(cfg.model, cfg.training, cfg.data)
        keys = models.get("qwen3_moe").model_cls(args).state_dict()
        assert any(k.endswith("expert_bias") for k in keys) is present
        assert not any(k.endswith("expert_load") for k in keys)  # per-step, not saved


def test_negative_rate_is_a_config_error(tmp_path):
    from torchllm.config import ConfigError

    with pytest.raises(ConfigError, match="model.moe_bias_update_rate"):
        tiny_config(tmp_path, "--model.name=qwen3_moe", "--model.moe_bias_update_rate=-1")


def rank_tokens(rank: int) -> torch.Tensor:
    """Each rank its own tokens: rank 1's lean away from expert 0."""
    return tokens(seed=10 + rank) * (1 if rank == 0 else -1)


def _two_rank_worker(rank: int, tmp_path) -> None:
    moe = skewed_moe(top_k=2)
    moe(rank_tokens(rank))
    loads = update_expert_bias([moe], rate=0.01, groups=[dist.group.WORLD])
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(
        {"bias": moe.expert_bias.tolist(), "loads": loads[0].tolist()}))


@pytest.mark.slow
def test_update_sums_the_loads_over_two_dp_ranks(tmp_path):
    spawn_gloo(_two_rank_worker, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    moe = skewed_moe(top_k=2)
    per_rank = [brute_force_loads(moe, rank_tokens(r)) for r in (0, 1)]

    def update(loads):
        mean = float(loads.mean())
        return [0.01 * ((mean > n) - (mean < n)) for n in loads.tolist()]

    total = per_rank[0] + per_rank[1]
    for r in ranks:
        assert r["loads"] == total.tolist()
        assert r["bias"] == pytest.approx(update(total), rel=1e-6)
    # Summing matters here: each rank's own loads would give another update.
    assert all(update(loads) != update(total) for loads in per_rank), per_rank


def fake_layer(counts: list[float], aux: float):
    from types import SimpleNamespace

    return SimpleNamespace(n_experts=len(counts), tokens_per_expert=torch.tensor(counts),
                           last_aux_loss=torch.tensor(aux), last_z_loss=torch.tensor(0.0))


# rank -> this rank's MoE layers as (tokens per expert, aux loss)
CP_PEERS = {0: [([1.0, 3.0], 1.0)], 1: [([2.0, 2.0], 2.0)]}  # the same layer, other tokens
PP_PEERS = {0: [([1.0, 3.0], 1.0)], 1: [([2.0, 2.0], 2.0), ([4.0, 0.0], 3.0)]}  # other layers


def _stats_worker(rank: int, tmp_path, role: str) -> None:
    from types import SimpleNamespace

    from torchllm.metrics.moe_stats import MoEStats, token_groups

    singletons = [dist.new_group([r]) for r in (0, 1)]  # every rank creates every group
    peers = dict(cp_group=dist.group.WORLD, pp_group=None) if role == "cp" else \
        dict(cp_group=None, pp_group=dist.group.WORLD)
    layers = [fake_layer(*layer) for layer in (CP_PEERS if role == "cp" else PP_PEERS)[rank]]
    dims = SimpleNamespace(dp_group=singletons[rank], **peers)
    stats = MoEStats(layers, log_freq=1, total_steps=1, groups=token_groups(dims),
                     pp_group=dims.pp_group, n_experts=2)  # as from_context builds it
    report = stats.on_step_end(None, 1, {})
    (tmp_path / f"stats{rank}.json").write_text(json.dumps(report.scalars))


@pytest.mark.slow
@pytest.mark.parametrize("role, share, max_load, aux", [
    ("cp", 3 / 8, 5 / 4, 1.5),  # counts [1, 3] + [2, 2]; aux losses of one layer averaged
    ("pp", 7 / 12, 2.0, 2.0),  # three layers: [1, 3], [2, 2], [4, 0]; max 4 / mean 2
])
def test_moe_stats_combine_context_and_pipeline_peers(tmp_path, role, share, max_load, aux):
    """cp peers route other tokens through the same layers (counts summed, losses averaged);
    pp peers hold other layers (statistics over all of them), as one process would log."""
    spawn_gloo(_stats_worker, tmp_path, role)
    for rank in (0, 1):
        s = json.loads((tmp_path / f"stats{rank}.json").read_text())
        assert s["moe/tokens_per_expert/e0"] == pytest.approx(share)
        assert s["moe/max_load"] == pytest.approx(max_load)
        assert s["moe/aux_loss"] == pytest.approx(aux)


def test_hugging_face_round_trip_with_balancing_on(caplog):
    """Qwen3MoE has no routing bias: import starts it at 0, export warns when it is not 0."""
    import logging

    from torchllm.models.qwen3.hf import Qwen3MoeAdapter
    from torchllm.models.qwen3 import Qwen3, moe_flavors

    args = moe_flavors["debug"].with_overrides(moe_bias_update_rate=0.01, n_layers=2)
    model = Qwen3(args)
    model.init_weights()
    sd = model.state_dict()
    back = Qwen3MoeAdapter.from_hf(Qwen3MoeAdapter.to_hf(sd, args, args.vocab_size), args)
    assert set(back) == set(sd)
    model.load_state_dict(back)  # strict: every key, the zero bias included
    assert not caplog.records
    sd["layers.0.feed_forward.expert_bias"][3] = 0.01
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        Qwen3MoeAdapter.to_hf(sd, args, args.vocab_size)
    assert "unbiased" in caplog.text


def test_lora_leaves_the_routing_biases_of_the_frozen_base_bit_identical(tmp_path, caplog):
    """LoRA on qwen3_moe with model.moe_bias_update_rate > 0: the base, its expert_bias buffers
    included, is bit-identical after training (the balancer is not attached, and says so);
    before, every expert_bias moved in 3 steps (issue 52, item 9)."""
    import logging

    from torchllm.metrics.moe_stats import MoEBiasBalancer
    from torchllm.models.lora import is_adapter_key
    from torchllm.train import Trainer

    cfg = tiny_config(tmp_path, "--model.name=qwen3_moe", "--model.moe_bias_update_rate=0.1",
                      "--lora.enable", "--training.steps=3", "--optimizer.lr=1e-2")
    with caplog.at_level(logging.INFO, logger="torchllm"):
        trainer = Trainer(cfg)
    assert not any(isinstance(cb, MoEBiasBalancer) for cb in trainer.callbacks)
    assert any("moe_bias_update_rate" in r.getMessage() and "frozen" in r.getMessage()
               for r in caplog.records)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if not is_adapter_key(k)}
    biases = [k for k in before if k.endswith("expert_bias")]
    assert biases
    trainer.train()
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if not torch.equal(before[k], after[k])]
    assert any(after[k].abs().max() > 0 for k in after if k.endswith("lora_B.weight"))
