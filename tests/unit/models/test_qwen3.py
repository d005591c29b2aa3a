"""Qwen3 dense and Qwen3-MoE: logits parity with `transformers` both ways, the MoE layer against
a naive per-expert loop, the load-balancing loss by hand, and training through the Trainer."""

import json

import pytest
import torch

from conftest import build_model, tiny_config
from builders.models import SEQ, TOL, VOCAB, randomize, tokens
from torchllm.hf.folder import write_hf_weights
from torchllm.hf.load import convert_from_hf
from torchllm.models.qwen3.hf import Qwen3Adapter, Qwen3MoeAdapter
from torchllm.models.moe import MoE, auxiliary_loss, load_balancing_loss, moe_layers
from torchllm.models.qwen3 import Qwen3, Qwen3Args

transformers = pytest.importorskip("transformers")

CASES = {
    "dense-tied": (Qwen3Adapter, Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                           head_dim=32, hidden_dim=96, vocab_size=128,
                                           max_seq_len=32, tie_embeddings=True)),
    "dense-untied": (Qwen3Adapter, Qwen3Args(dim=48, n_layers=2, n_heads=4, n_kv_heads=4,
                                             head_dim=16, hidden_dim=80, vocab_size=128,
                                             max_seq_len=32, rope_theta=1e4)),
    "moe": (Qwen3MoeAdapter, Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                       hidden_dim=96, vocab_size=128, max_seq_len=32,
                                       n_experts=4, n_experts_per_tok=2, moe_hidden_dim=32)),
    "moe-unnormalized": (Qwen3MoeAdapter, Qwen3Args(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=128,
        max_seq_len=32, n_experts=4, n_experts_per_tok=2, moe_hidden_dim=32,
        norm_topk_prob=False)),
}


def ours(args, seed=0):
    model = build_model(Qwen3, args, seed)
    randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("case", CASES)
def test_torchllm_to_hf_logits_match(tmp_path, case):
    adapter, args = CASES[case]
    model = ours(args)
    write_hf_weights(adapter.to_hf(model.state_dict(), args, VOCAB), tmp_path, 10**9)
    (tmp_path / "config.json").write_text(json.dumps(adapter.config(args, VOCAB)))
    x = tokens()
    with torch.no_grad():
        mine = model(x)[..., :VOCAB]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == adapter.config(args, VOCAB)["architectures"][0]
    with torch.no_grad():
        theirs = hf(x).logits
    assert theirs.shape == (2, SEQ, VOCAB)
    assert (mine - theirs).abs().max().item() < TOL


@pytest.mark.parametrize("case", CASES)
def test_hf_to_torchllm_logits_match(tmp_path, case):
    adapter, args = CASES[case]
    config = transformers.AutoConfig.for_model(**adapter.config(args, VOCAB))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=1)
    hf.save_pretrained(tmp_path)
    model = ours(args, seed=2)
    model.load_state_dict(convert_from_hf(tmp_path, adapter, args))
    x = tokens()
    with torch.no_grad():
        assert (model(x)[..., :VOCAB] - hf.eval()(x).logits).abs().max().item() < TOL


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its top-k experts, one at a time."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.gate(flat).float(), -1)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        weights, experts = probs[t].topk(moe.top_k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            w1, w2, w3 = (getattr(moe.experts, n)[e] for n in ("w1", "w2", "w3"))
            h = torch.nn.functional.silu(flat[t] @ w1.T) * (flat[t] @ w3.T)
            out[t] += w * (h @ w2.T)
    return out.reshape(x.shape)


@pytest.mark.parametrize("norm", [True, False])
def test_moe_layer_equals_a_naive_per_expert_loop(norm):
    torch.manual_seed(0)
    moe = MoE(dim=16, hidden_dim=24, n_experts=5, top_k=2, norm_topk_prob=norm)
    moe.init_weights(1.0)
    x = torch.randn(3, 7, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = moe(x)
    ref = naive_moe(moe, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    grads_ref = torch.autograd.grad(ref.square().sum(), [x_ref, *moe.parameters()])
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert int(moe.tokens_per_expert.sum()) == 3 * 7 * 2


def test_load_balancing_loss_by_hand():
    # 4 tokens, 2 experts, top-1: tokens 0,1,2 -> expert 0; token 3 -> expert 1.
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [3.0, 1.0], [0.0, 2.0]])
    experts = logits.topk(1, dim=-1).indices
    p = torch.softmax(logits, -1)
    f = torch.tensor([3 / 4, 1 / 4])
    expected = 2 * (f[0] * p[:, 0].mean() + f[1] * p[:, 1].mean())
    assert load_balancing_loss(logits, experts, 2).item() == pytest.approx(expected.item())
    # Perfect balance with uniform probabilities gives exactly 1.
    uniform = torch.zeros(4, 2)
    balanced = torch.tensor([[0], [1], [0], [1]])
    assert load_balancing_loss(uniform, balanced, 2).item() == pytest.approx(1.0)


def test_auxiliary_loss_is_the_mean_over_layers_and_trains_the_router():
    args = CASES["moe"][1]
    model = build_model(Qwen3, args).train()
    model(tokens() % 128)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    expected = sum(0.01 * m.aux_loss + 0.001 * m.z_loss for m in layers) / len(layers)
    aux = auxiliary_loss(moe_layers(model), 0.01, 0.001)
    assert aux.item() == pytest.approx(expected.item())
    aux.backward()
    assert all(m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0
               for m in layers)
    assert auxiliary_loss(moe_layers(model), 0.01, 0.001) is None  # consumed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_trainer_trains_qwen3(tmp_path, name):
    from torchllm.train import Trainer

    trainer = Trainer(tiny_config(tmp_path, f"--model.name={name}", "--training.steps=8",
                                  "--optimizer.lr=3e-3"))
    losses = trainer.train()
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_published_parameter_counts():
    """Qwen's model cards: 0.6B = 0.6B total / 0.44B non-embedding; 30B-A3B = 30.5B total,
    3.3B activated."""
    from torchllm.config import load_config
    from torchllm.tools.model_info import model_info

    def info(name, flavor):
        cfg = load_config([f"--model.name={name}", f"--model.flavor={flavor}",
                           "--data.tokenizer_vocab_size=151936"])
        return model_info(cfg.model, cfg.training, cfg.data)

    dense = info("qwen3", "0.6B")
    assert round(dense["params"] / 1e9, 1) == 0.6
    assert round(dense["non_embedding_params"] / 1e9, 2) == 0.44
    moe = info("qwen3_moe", "30B-A3B")
    assert round(moe["params"] / 1e9, 1) == 30.5
    assert 3.3e9 <= moe["active_params"] < 3.4e9  # "3.3B activated"
    # FLOPs count the parameters a token runs through, not every expert.
    assert moe["flops_per_token"] < 6 * moe["active_non_embedding_params"] * 1.5


def test_trainer_adds_the_weighted_aux_loss_to_the_gradient(tmp_path):
    """One step's gradient equals that of mean token CE + coef * (mean over layers of aux),
    computed by hand on an identical model."""
    from torchllm.train import Trainer

    coef, z = 0.5, 0.1
    trainer = Trainer(tiny_config(tmp_path, "--model.name=qwen3_moe", "--training.steps=1",
                                  f"--model.moe_aux_loss_coef={coef}",
                                  f"--model.moe_z_loss_coef={z}", "--training.max_norm=0"))
    reference = build_model(Qwen3, trainer.model_args)
    reference.load_state_dict(trainer.model.state_dict())
    batch = next(trainer.batches)
    trainer.module.train_batch([batch])
    logits = reference(batch["inputs"])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    layers = [m for m in reference.modules() if isinstance(m, MoE)]
    aux = sum(coef * m.aux_loss + z * m.z_loss for m in layers) / len(layers)
    (ce + aux).backward()
    for (name, p), q in zip(trainer.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_moe_stats_reach_tensorboard_scalars(tmp_path):
    from torchllm.train import Trainer

    trainer = Trainer(tiny_config(tmp_path, "--model.name=qwen3_moe", "--training.steps=2"))
    logged = {}
    log_eval = trainer.metrics.log_eval
    trainer.metrics.log_eval = lambda step, s, t: (logged.update({step: s}), log_eval(step, s, t))
    trainer.train()
    s = logged[2]
    n_experts = trainer.model_args.n_experts
    shares = [s[f"moe/tokens_per_expert/e{e}"] for e in range(n_experts)]
    assert sum(shares) == pytest.approx(1.0)
    assert s["moe/max_load"] >= 1.0 and s["moe/aux_loss"] > 0 and s["moe/dropped_fraction"] == 0


def test_kv_cache_decoding_equals_full_forward():
    """Llama's KV cache under Qwen3's QK-norm and half-split RoPE: decoding token by token gives
    the logits of one full forward (dense and MoE)."""
    from torchllm.models.kv_cache import KVCache

    for case in ("dense-untied", "moe"):
        args = CASES[case][1]
        model = ours(args)
        x = tokens()[:, :12]
        with torch.no_grad():
            full = model(x)
            cache = KVCache(max_len=16)
            steps = [model(x[:, :5], cache=cache)] + [model(x[:, i:i + 1], cache=cache)
                                                      for i in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_tensor_parallel_qwen3_is_accepted(tmp_path, name):
    """TP of both families is checked like Llama's (parity: test_parallel_multiprocess)."""
    from torchllm.config import ConfigError
    from builders.models import layout_dims

    args = (f"--model.name={name}", "--parallelism.data_parallel_shard_degree=1")
    cfg = tiny_config(tmp_path, *args, "--model.tie_embeddings=false",
                      "--parallelism.tensor_parallel_degree=2")
    assert layout_dims(cfg, 2, "cpu").tp == 2
    cfg = tiny_config(tmp_path, *args, "--model.tie_embeddings=false",
                      "--parallelism.tensor_parallel_degree=8")  # debug: 4 KV heads
    with pytest.raises(ConfigError, match="n_kv_heads = 4"):
        layout_dims(cfg, 8, "cpu")
