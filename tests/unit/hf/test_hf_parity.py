"""Logits parity with `transformers` in both directions, for tiny random Llama and GPT-2 configs.

The oracle is the `transformers` implementation itself, built from a config in code (nothing is
downloaded). Every parameter is randomized (norm gains and biases included), so a wrong name,
transpose or permutation shows up in the logits.
"""

import json

import pytest
import torch

from torchllm.hf.folder import write_hf_weights
from torchllm.hf.load import convert_from_hf
from torchllm.models.gpt2.hf import GPT2Adapter
from torchllm.models.llama.hf import LlamaAdapter
from torchllm.models.gpt2 import GPT2, GPT2Args
from torchllm.models.llama import LlamaArgs, Transformer

from conftest import build_model
from builders.models import SEQ, TOL, VOCAB, randomize, tokens  # noqa: F401

transformers = pytest.importorskip("transformers")


LLAMA = {
    "mha-untied": LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, hidden_dim=96,
                            max_seq_len=32, rope_theta=10000.0),
    "gqa-tied": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                          hidden_dim=96, max_seq_len=32, tie_embeddings=True),
    "gqa-untied-rope-scaling": LlamaArgs(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=128, hidden_dim=80,
        max_seq_len=32, rope_scaling=True, rope_scaling_factor=4.0, rope_original_max_pos=16),
}
GPT = {
    "tied": GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32),
    "untied": GPT2Args(dim=48, n_layers=2, n_heads=3, vocab_size=128, max_seq_len=32,
                       tie_embeddings=False),
}
FAMILIES = [(LlamaAdapter, Transformer, a) for a in LLAMA.values()] + [
    (GPT2Adapter, GPT2, a) for a in GPT.values()]
IDS = [f"llama-{k}" for k in LLAMA] + [f"gpt2-{k}" for k in GPT]


def torchllm_model(model_cls, args, seed=0):
    model = build_model(model_cls, args, seed)
    randomize(model, seed)
    return model.eval()


def hf_logits(hf_dir, x):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(x).logits


@pytest.mark.parametrize("adapter,model_cls,args", FAMILIES, ids=IDS)
def test_torchllm_to_hf_logits_match(tmp_path, adapter, model_cls, args):
    model = torchllm_model(model_cls, args)
    write_hf_weights(adapter.to_hf(model.state_dict(), args, VOCAB), tmp_path, 10**9)
    (tmp_path / "config.json").write_text(json.dumps(adapter.config(args, VOCAB)))
    x = tokens()
    with torch.no_grad():
        ours = model(x)[..., :VOCAB]
    theirs = hf_logits(tmp_path, x)
    assert theirs.shape == (2, SEQ, VOCAB)
    assert (ours - theirs).abs().max().item() < TOL


@pytest.mark.parametrize("adapter,model_cls,args", FAMILIES, ids=IDS)
def test_hf_to_torchllm_logits_match(tmp_path, adapter, model_cls, args):
    config = transformers.AutoConfig.for_model(**adapter.config(args, VOCAB))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=1)
    if args.tie_embeddings:
        assert hf.lm_head.weight is hf.get_input_embeddings().weight
    hf.save_pretrained(tmp_path)
    model = torchllm_model(model_cls, args, seed=2)
    model.load_state_dict(convert_from_hf(tmp_path, adapter, args))
    x = tokens()
    with torch.no_grad():
        ours = model(x)
        theirs = hf.eval()(x).logits
    assert (ours[..., :VOCAB] - theirs).abs().max().item() < TOL
    # Padded rows are zero: their logits are exactly 0 and never sampled from real targets.
    assert torch.all(model.tok_embeddings.weight[VOCAB:] == 0)


def test_gpt2_files_without_the_transformer_prefix_load(tmp_path):
    """OpenAI's GPT-2 files on the Hub name weights `h.0.attn.c_attn.weight`, `wte.weight`, ..."""
    from safetensors.torch import load_file, save_file

    args = GPT["tied"]
    config = transformers.AutoConfig.for_model(**GPT2Adapter.config(args, VOCAB))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()},
              bare / "model.safetensors")
    (bare / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    a = convert_from_hf(tmp_path / "hf", GPT2Adapter, args)
    b = convert_from_hf(bare, GPT2Adapter, args)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    args = LLAMA["gqa-tied"]
    config = transformers.AutoConfig.for_model(**LlamaAdapter.config(args, VOCAB))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lack 'model.layers.1.mlp.up_proj.weight'"):
        convert_from_hf(tmp_path, LlamaAdapter, args)
