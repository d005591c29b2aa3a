import math

import pytest
import torch
import torch.nn.functional as F

from torchllm import models
from torchllm.config import load_config
from torchllm.loss import cross_entropy_sum
from torchllm.models.llama.args import LlamaArgs, flavors
from torchllm.models.llama.model import Transformer, apply_rope, rope_frequencies, rope_table

from conftest import REPO, build_model
from messages import raises_naming


def build(args: LlamaArgs, seed: int = 0) -> Transformer:
    return build_model(Transformer, args, seed)


TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)


def test_reference_1b_has_exact_parameter_count_on_meta():
    cfg = load_config([f"--job.config_file={REPO / 'train_configs' / 'llama3_1b.toml'}"])
    args = models.model_args(cfg.model, cfg.training, cfg.data)
    assert args.vocab_size == 131072 and args.dim == 2048 and args.n_layers == 16
    assert (args.n_heads, args.n_kv_heads, args.ffn_hidden_dim) == (32, 8, 8192)
    assert args.tie_embeddings and args.rope_theta == 500000
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 1_241_581_568


@pytest.mark.parametrize("flavor", list(flavors))
def test_every_flavor_builds_on_meta(flavor):
    with torch.device("meta"):
        model = Transformer(flavors[flavor])
    assert all(p.is_meta for p in model.parameters())


def test_llama3_8b_shapes():
    args = flavors["8B"]
    assert args.ffn_hidden_dim == 14336
    with torch.device("meta"):
        model = Transformer(args)
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9


def test_vocab_padding_multiple_and_pow2():
    assert models.padded_vocab_size(50257, 64) == 50304
    assert models.padded_vocab_size(128256, 64, pow2=True) == 131072
    cfg = load_config(["--model.vocab_pad_multiple=128"])
    args = models.model_args(cfg.model, cfg.training, cfg.data, tokenizer_vocab_size=1000)
    assert args.vocab_size == 1024


def test_model_vocab_smaller_than_tokenizer_is_an_error():
    cfg = load_config(["--model.vocab_size=100"])
    with raises_naming(ValueError, "model.vocab_size = 100", "512"):  # the value, the tokenizer's
        models.model_args(cfg.model, cfg.training, cfg.data, tokenizer_vocab_size=512)


def test_init_statistics():
    args = LlamaArgs(dim=256, n_layers=8, n_heads=8, vocab_size=4096, max_seq_len=16)
    model = build(args)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    wq = model.layers["0"].attention.wq.weight
    assert wq.std().item() == pytest.approx(256**-0.5, rel=0.1)
    wo = model.layers["0"].attention.wo.weight
    assert wo.std().item() == pytest.approx(256**-0.5 / math.sqrt(16), rel=0.1)
    w2 = model.layers["0"].feed_forward.w2.weight
    assert w2.std().item() == pytest.approx(args.ffn_hidden_dim**-0.5 / 4, rel=0.1)
    assert torch.equal(model.rope_cache, rope_table(args))


def test_loss_at_init_is_about_ln_vocab():
    # Tied: logits are h·E with E ~ 0.02, nearly uniform, so loss ~ ln(V).
    torch.manual_seed(0)
    args = LlamaArgs(dim=128, n_layers=2, n_heads=4, vocab_size=4096, max_seq_len=64,
                     tie_embeddings=True)
    model = build(args)
    tokens = torch.randint(0, 4096, (4, 65))
    with torch.no_grad():
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
    assert abs(loss.item() - math.log(4096)) < 0.1
    # Untied: the head's 1/sqrt(dim) init gives unit-variance logits: ln(V) + 1/2.
    model = build(LlamaArgs(dim=128, n_layers=2, n_heads=4, vocab_size=4096, max_seq_len=64))
    with torch.no_grad():
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
    assert abs(loss.item() - (math.log(4096) + 0.5)) < 0.15


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = build(TINY)
    tokens = torch.randint(0, 256, (2, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / 64
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_causality_future_tokens_do_not_change_past_logits():
    model = build(TINY)
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[0, :10], lb[0, :10])
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build(TINY)
    mha_args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256,
                         max_seq_len=32)
    mha = build(mha_args)
    state = gqa.state_dict()
    for i in range(2):
        for name in ("wk", "wv"):
            w = state[f"layers.{i}.attention.{name}.weight"].view(2, 16, 64)
            state[f"layers.{i}.attention.{name}.weight"] = w.repeat_interleave(2, 0).reshape(64, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_rope_matches_complex_reference():
    args = LlamaArgs(dim=64, n_heads=4, max_seq_len=16)
    x = torch.randn(2, 16, 4, 16)
    freqs = torch.polar(torch.ones(16, 8), torch.outer(torch.arange(16.0), rope_frequencies(args)))
    ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs[None, :, None])
    torch.testing.assert_close(apply_rope(x, rope_table(args)), ref.flatten(-2))
    # Compiled, the rotation is spelled in reals (inductor generates no code for complex ops):
    # the same values, for one table and for per-sequence tables.
    torch._dynamo.reset()
    compiled = torch.compile(apply_rope, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, rope_table(args)), ref.flatten(-2))
    per_seq = rope_table(args)[None].expand(2, -1, -1, -1)
    torch.testing.assert_close(compiled(x, per_seq), ref.flatten(-2))


def llama31_apply_scaling(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's reference `apply_scaling` (meta-llama/llama-models), one frequency at a time
    in float64."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return new_freqs


@pytest.mark.parametrize("factor, head_dim", [(8.0, 128), (32.0, 64)])
def test_rope_scaling_matches_the_llama31_reference_formula(factor, head_dim):
    """Every frequency, including the interpolated band between the two wavelength cut-offs."""
    args = LlamaArgs(dim=head_dim, n_heads=1, rope_scaling=True, rope_scaling_factor=factor)
    plain = rope_frequencies(LlamaArgs(dim=head_dim, n_heads=1)).double().tolist()
    expected = llama31_apply_scaling(plain, factor, args.rope_low_freq_factor,
                                     args.rope_high_freq_factor, args.rope_original_max_pos)
    wavelen = [2 * math.pi / f for f in plain]
    band = [i for i, w in enumerate(wavelen) if 8192 / 4 <= w <= 8192 / 1]
    assert len(band) >= 3  # the interpolated band is really exercised
    assert band[0] > 0 and band[-1] < len(plain) - 1  # and both untouched ends too
    got = rope_frequencies(args)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32),
                               rtol=1e-6, atol=0)


def test_tied_model_has_one_table():
    model = build(LlamaArgs(dim=64, n_heads=4, vocab_size=256, tie_embeddings=True))
    assert model.output is None
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in model.named_parameters() if "output" not in n
    )


def test_loss_is_float32_and_ignores_padding():
    logits = torch.randn(2, 4, 10, dtype=torch.bfloat16)
    targets = torch.tensor([[1, 2, -100, 3], [4, -100, -100, 5]])
    loss = cross_entropy_sum(logits, targets)
    assert loss.dtype == torch.float32
    keep = targets != -100
    ref = F.cross_entropy(logits.float()[keep], targets[keep], reduction="sum")
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_dropout_is_training_only_and_follows_the_seed(family):
    """model.dropout: in eval mode the model equals the dropout-free one exactly; in training the
    masks come from the torch RNG (same seed, same output; another seed, another output)."""
    if family == "llama3":
        plain = build(TINY)
        args = LlamaArgs(**{**TINY.__dict__, "dropout": 0.3})
        model = build(args)
    else:
        from torchllm.models.gpt2 import GPT2, GPT2Args

        tiny = GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32)
        plain = build_model(GPT2, tiny)
        model = build_model(GPT2, GPT2Args(**{**tiny.__dict__, "dropout": 0.3}))
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name  # dropout adds no parameter and changes no init
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain.train()
        reference = plain(tokens)
        model.eval()
        assert torch.equal(model(tokens), reference)
        model.train()
        outs = []
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            outs.append(model(tokens))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    # Both the attention probabilities and the residual branches are dropped: ~p of the
    # residual contributions vanish, so the output moves by a lot, not by rounding.
    assert (outs[0] - reference).abs().mean() > 0.1 * reference.abs().mean()


def test_dropout_config_reaches_both_families_and_is_validated():
    from torchllm.config import ConfigError

    for name in ("llama3", "gpt2"):
        cfg = load_config([f"--model.name={name}", "--model.dropout=0.1"])
        assert models.model_args(cfg.model, cfg.training, cfg.data).dropout == 0.1
    with raises_naming(ConfigError, "model.dropout = 1.0", "[0, 1)"):  # the value, the range
        load_config(["--model.dropout=1.0"])
