"""`python -m torchllm.hf import` validates a Hugging Face folder before it writes anything:
quantized folders, non-float dtypes, NaN/inf weights, unknown tensors, wrong shapes and a
`vocab_size` other than the embedding's rows are each one line and exit 2, with no seed written
(issue 52, items 7 and 8)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchllm import models
from torchllm.hf.cli import main as hf_cli
from torchllm.hf.folder import write_hf_weights
from torchllm.models import adapter_for_model

from conftest import build_model, tiny_args, tiny_config

VOCAB = 512
# The target model: qwen3 debug (its conversion reshapes nothing, so a wrong shape would be
# written as is), vocab padded 512 -> 576 so that the seed has rows to pad.
TARGET = ("--model.name=qwen3", "--model.vocab_pad_multiple=96")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A valid Hugging Face folder of the qwen3 debug model (written by the adapter, as export
    writes it, without training)."""
    tmp = tmp_path_factory.mktemp("hf")
    cfg = tiny_config(tmp, *TARGET)
    args = models.model_args(cfg.model, cfg.training, cfg.data, VOCAB)
    model = build_model(models.get("qwen3").model_cls, args)
    adapter = adapter_for_model("qwen3")
    out = tmp / "hf"
    out.mkdir()
    write_hf_weights(adapter.to_hf(model.state_dict(), args, VOCAB), out, 10**9)
    (out / "config.json").write_text(json.dumps(adapter.config(args, VOCAB)))
    return out


def changed(src: Path, dst: Path, config=None, weights=None) -> Path:
    """A copy of the folder src with its config.json and/or weights changed in place."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        tensors = load_file(dst / "model.safetensors")
        weights(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def run_import(tmp_path, hf: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "seeds" / "step-0"
    code = hf_cli(["import", "--hf", str(hf), "--out", str(out),
                   *tiny_args(tmp_path, *TARGET), *extra])
    return code, out


def refused(tmp_path, capsys, hf: Path, *must_name: str, extra=()) -> str:
    """The import exits 2 with one line naming each of must_name, and writes nothing."""
    code, out = run_import(tmp_path, hf, *extra)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1, err
    for name in must_name:
        assert name in lines[0], lines[0]
    assert not out.exists() and not any(out.parent.glob(".step-0*")), list(out.parent.iterdir())
    return lines[0]


def test_a_valid_folder_imports_with_the_stated_padding(hf_folder, tmp_path):
    code, out = run_import(tmp_path, hf_folder)
    assert code == 0
    from torchllm.checkpoint import open_checkpoint

    weights = open_checkpoint(out).weights()
    assert weights["tok_embeddings.weight"].shape[0] == 576  # 512 rounded up by 96
    assert torch.all(weights["tok_embeddings.weight"][VOCAB:] == 0)


def fp8_block_scaled(w):
    """As Qwen3-FP8 ships: fp8 projections, each with a `weight_scale_inv`."""
    for name in [k for k in w if k.endswith("proj.weight")]:
        w[name] = (w[name] * 100).to(torch.float8_e4m3fn)
        w[name + "_scale_inv"] = torch.full((1, 1), 0.01)


def test_a_quantized_folder_is_refused(hf_folder, tmp_path, capsys):
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    hf = changed(hf_folder, tmp_path / "fp8", lambda c: c.update(quantization_config=quant),
                 fp8_block_scaled)
    refused(tmp_path, capsys, hf, str(hf / "config.json"), "quantization_config", "'fp8'")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bool])
def test_a_non_float_tensor_is_refused(hf_folder, tmp_path, capsys, dtype):
    name = "model.layers.1.mlp.up_proj.weight"

    def cast(w):
        w[name] = w[name].to(dtype)

    hf = changed(hf_folder, tmp_path / "cast", weights=cast)
    refused(tmp_path, capsys, hf, str(hf / "model.safetensors"), name,
            str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(hf_folder, tmp_path, capsys, bad):
    name = "model.layers.0.self_attn.k_proj.weight"

    def poison(w):
        w[name][3, 5] = bad

    hf = changed(hf_folder, tmp_path / "nan", weights=poison)
    refused(tmp_path, capsys, hf, str(hf / "model.safetensors"), name, "non-finite")


def test_unknown_tensors_are_refused(hf_folder, tmp_path, capsys):
    def extra(w):
        w["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(8)
        w["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(1, 1)

    hf = changed(hf_folder, tmp_path / "extra", weights=extra)
    refused(tmp_path, capsys, hf, "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.mlp.gate_proj.weight_scale_inv")


def test_a_wrong_shape_is_refused_before_the_seed_is_written(hf_folder, tmp_path, capsys):
    name = "model.layers.0.self_attn.q_proj.weight"

    def reshape(w):
        w[name] = torch.zeros(w[name].shape[0] + 8, w[name].shape[1])

    hf = changed(hf_folder, tmp_path / "shape", weights=reshape)
    refused(tmp_path, capsys, hf, name, str(hf))


@pytest.mark.parametrize("vocab", [500, 3_000_000])
def test_vocab_size_must_equal_the_embedding_rows(hf_folder, tmp_path, capsys, vocab):
    """3,000,000 with 512 rows once padded a 5.8 GB seed; now: one line, nothing allocated."""
    hf = changed(hf_folder, tmp_path / "vocab", lambda c: c.update(vocab_size=vocab))
    line = refused(tmp_path, capsys, hf, "model.embed_tokens.weight", f"{VOCAB} rows",
                   f"vocab_size = {vocab}")
    assert "model.vocab_pad_multiple" in line  # the padding rule


@pytest.mark.parametrize("vocab", [-5, 0, "512", 512.0, True, None])
def test_vocab_size_must_be_a_positive_integer(hf_folder, tmp_path, capsys, vocab):
    hf = changed(hf_folder, tmp_path / "vocab", lambda c: c.update(vocab_size=vocab))
    refused(tmp_path, capsys, hf, str(hf / "config.json"), f"vocab_size = {vocab!r}")


def test_a_cast_that_overflows_the_dtype_is_refused(hf_folder, tmp_path, capsys):
    name = "model.norm.weight"

    def big(w):
        w[name][0] = 1e6  # finite in float32, inf in float16

    hf = changed(hf_folder, tmp_path / "big", weights=big)
    refused(tmp_path, capsys, hf, "norm.weight", "float16", extra=("--dtype", "float16"))


def test_a_relative_out_records_an_absolute_tokenizer_path(hf_folder, tmp_path, monkeypatch):
    """`hf import --out REL`: the seed's config.toml names its tokenizer copy by an absolute
    path (a run from the seed may start in another directory)."""
    import tomllib

    hf = changed(hf_folder, tmp_path / "withtok")
    words = [f"w{i}" for i in range(VOCAB - 2)]
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(["<s>", "</s>", *words])},
                                         unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    monkeypatch.chdir(tmp_path)
    assert hf_cli(["import", "--hf", str(hf), "--out", "rel/step-0",
                   *tiny_args(tmp_path, *TARGET)]) == 0
    recorded = tomllib.loads((tmp_path / "rel" / "step-0" / "config.toml").read_text())
    name = recorded["data"]["tokenizer"]
    assert Path(name).is_absolute() and Path(name) == tmp_path / "rel" / "step-0" / "tokenizer.json"


@pytest.mark.parametrize("change,named", [
    ({"rope_theta": "1e6"}, "rope_theta = '1e6'"),
    ({"rms_norm_eps": None, "rope_theta": float("nan")}, "rope_theta = nan"),
    ({"rope_scaling": "linear"}, "rope_scaling = 'linear'"),
    ({"num_attention_heads": None}, "num_attention_heads"),
], ids=["str", "nan", "table", "missing"])
def test_other_bad_config_values_are_one_line(hf_folder, tmp_path, capsys, change, named):
    def edit(c):
        c.update(change)
        if change.get("num_attention_heads", 0) is None:
            del c["num_attention_heads"]

    hf = changed(hf_folder, tmp_path / "cfg", edit)
    refused(tmp_path, capsys, hf, named)
