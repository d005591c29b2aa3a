import math

import pytest
import torch

from torchllm import models
from torchllm.config import load_config
from torchllm.metrics.flops import flops_per_token, parameter_counts
from torchllm.models.gpt2 import GPT2, GPT2Args, flavors
from torchllm.optim import param_groups
from torchllm.train import Trainer

from conftest import REPO, build_model, tiny_config
from messages import raises_naming

GPT2_ARGS = ["--model.name=gpt2"]


def build(args: GPT2Args, seed: int = 0) -> GPT2:
    return build_model(GPT2, args, seed)


TINY = GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32)


def test_124m_has_124_439_808_params_at_vocab_50257():
    # The count assumes GPT-2's unpadded vocab of 50,257, 1,024 positions and tied embeddings.
    cfg = load_config([*GPT2_ARGS, "--model.flavor=124M", "--model.vocab_size=50257",
                       "--model.vocab_pad_multiple=1", "--training.seq_len=1024"])
    args = models.model_args(cfg.model, cfg.training, cfg.data)
    assert (args.vocab_size, args.max_seq_len, args.tie_embeddings) == (50257, 1024, True)
    with torch.device("meta"):
        model = models.get("gpt2").build(args)
    assert parameter_counts(model)["params"] == 124_439_808


def test_shipped_124m_config_pads_vocab_to_50304():
    cfg = load_config([f"--job.config_file={REPO / 'train_configs' / 'gpt2_124m_fineweb.toml'}"])
    args = models.model_args(cfg.model, cfg.training, cfg.data)
    assert (args.vocab_size, args.max_seq_len) == (50304, 1024)
    with torch.device("meta"):
        model = GPT2(args)
    assert parameter_counts(model)["params"] == 124_439_808 + (50304 - 50257) * 768


@pytest.mark.parametrize("flavor", ["124M", "350M", "774M", "1.5B"])
def test_flavors_match_transformers_gpt2_parameter_counts(flavor):
    transformers = pytest.importorskip("transformers")
    args = flavors[flavor]
    config = transformers.GPT2Config(n_embd=args.dim, n_layer=args.n_layers, n_head=args.n_heads)
    with torch.device("meta"):
        ours = GPT2(args)
        theirs = transformers.GPT2LMHeadModel(config)
    # HF counts the tied head once too (num_parameters dedups shared tensors).
    assert parameter_counts(ours)["params"] == theirs.num_parameters()


def test_module_names_mirror_llama():
    names = {n for n, _ in build(TINY).named_parameters()}
    for suffix in ("attention.wq.weight", "attention.wq.bias", "attention.wo.bias",
                   "feed_forward.w1.weight", "feed_forward.w2.bias", "attention_norm.bias"):
        assert f"layers.0.{suffix}" in names
    assert {"tok_embeddings.weight", "pos_embeddings.weight", "norm.weight", "norm.bias"} <= names
    assert not any("w3" in n or n.startswith("output") for n in names)


def test_init_statistics():
    args = GPT2Args(dim=256, n_layers=8, n_heads=8, vocab_size=4096, max_seq_len=64)
    model = build(args)
    block = model.layers["0"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(block.attention.wq.bias == 0) and torch.all(block.ffn_norm.weight == 1)
    assert model.pos_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_block_matches_a_direct_formula():
    torch.manual_seed(0)
    model = build(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randint(0, 256, (2, 10))
    block = model.layers["0"]
    h = model.tok_embeddings.weight[x] + model.pos_embeddings.weight[:10]
    ln1 = torch.nn.functional.layer_norm(h, (64,), block.attention_norm.weight,
                                         block.attention_norm.bias, 1e-5)
    q, k, v = (ln1 @ w.weight.T + w.bias for w in
               (block.attention.wq, block.attention.wk, block.attention.wv))
    q, k, v = (t.view(2, 10, 4, 16).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, 64)
    h = h + att @ block.attention.wo.weight.T + block.attention.wo.bias
    ln2 = torch.nn.functional.layer_norm(h, (64,), block.ffn_norm.weight, block.ffn_norm.bias, 1e-5)
    u = ln2 @ block.feed_forward.w1.weight.T + block.feed_forward.w1.bias
    gelu = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    expected = h + gelu @ block.feed_forward.w2.weight.T + block.feed_forward.w2.bias
    with torch.no_grad():
        got = block(model.tok_embeddings(x) + model.pos_embeddings(torch.arange(10)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class ListCache:
    """The KV-cache protocol the models share (`pos`, `update(layer, k, v)`), kept minimal."""

    def __init__(self):
        self.pos = 0
        self.kv = {}

    def update(self, layer, k, v):
        old_k, old_v = self.kv.get(layer, (k[:, :0], v[:, :0]))
        self.kv[layer] = (torch.cat([old_k, k], 1), torch.cat([old_v, v], 1))
        return self.kv[layer]


def test_incremental_decoding_with_a_kv_cache_matches_full_forward():
    model = build(TINY).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = ListCache()
    with torch.no_grad():
        full = model(tokens)
        # a 12-token prefill, then one token at a time (positions continue from cache.pos)
        steps = [model(tokens[:, :12], cache)] + [model(tokens[:, i:i + 1], cache)
                                                   for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.pos == 20
    with raises_naming(ValueError, "33", "max_seq_len 32"):  # the length, the model's limit
        model(tokens[:, :13], cache)


def test_too_long_sequence_is_an_error():
    with raises_naming(ValueError, "33", "max_seq_len 32"):
        build(TINY)(torch.zeros(1, 33, dtype=torch.long))


def test_weight_decay_skips_biases_norms_and_both_embeddings():
    model = build(TINY)
    decay, no_decay = param_groups(model, 0.1, decay_embeddings=False)
    decayed = {id(p) for p in decay["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "layers.0.attention.wq.weight" in names and "layers.1.feed_forward.w2.weight" in names
    assert not any(n.endswith("bias") or "norm" in n or "embeddings" in n for n in names)
    decay, _ = param_groups(model, 0.1, decay_embeddings=True)  # build-nanogpt: all 2-D weights
    assert len(decay["params"]) == sum(p.ndim == 2 for p in model.parameters())


def test_flops_per_token_counts_tied_head():
    model = build(TINY)
    n = parameter_counts(model)["non_embedding_params"] + 256 * 64
    assert flops_per_token(model, 32) == 6 * n + 12 * 2 * 4 * 16 * 32


@pytest.mark.slow
def test_trains_and_resumes_through_the_trainer(tmp_path):
    """Registry, trainer, optimizer groups, metrics and checkpointing work unchanged for GPT-2:
    2 steps, save, resume, 4 more steps give the losses of 6 steps in one go, bit for bit."""
    args = (*GPT2_ARGS, "--checkpoint.enable", "--checkpoint.interval=2", "--job.run_name=run",
            "--training.steps=6")
    straight = Trainer(tiny_config(tmp_path / "straight", *args))
    straight_losses = straight.train()
    first = Trainer(tiny_config(tmp_path, *args, "--training.stop_after_steps=2"))
    assert isinstance(first.model, GPT2) and first.model.pos_embeddings.weight.shape[0] == 32
    losses = first.train()
    resumed = Trainer(tiny_config(tmp_path, *args))
    assert resumed.step == 2
    for (name, a), b in zip(first.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    losses += resumed.train()
    assert losses == straight_losses
    assert losses[-1] < math.log(512)
    for (name, a), b in zip(straight.model.state_dict().items(),
                            resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
